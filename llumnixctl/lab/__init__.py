"""The local lab: clusters on this machine (up, down, add), hosts as network namespaces, generated models."""
