"""Policies in modules of their own. Each module here declares its policy (a subclass of a policy class of
daemons/policy/registry.py) and registers it in its registry (``DISPATCH.register(...)``) as it is imported;
the registry imports every module here once it has registered its own policies, so a new policy is one file
here (and its test): its name is then a choice of its setting, in the settings' help, the daemons' ``--help``
and ``llumnixctl policy``. Like the rest of daemons/policy/, a plugin is a pure function of plain values: it
may import daemons/policy/ only.
"""
