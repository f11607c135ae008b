"""``python -m daemons.instance``: what the systemd unit and llumnixctl's local clusters run."""

from daemons.instance.daemon import entry

entry()
