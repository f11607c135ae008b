"""``python -m daemons.manager``: what the systemd unit and llumnixctl's local clusters run."""

from daemons.manager.daemon import entry

entry()
