"""llumnixctl: the operator CLI of a Llumnix cluster."""
