#!/usr/bin/env bash
# Install the toolkit's system files: the systemd units, the llumnix system user (sysusers.d), the polkit rule
# that lets the manager's launcher start instances, the man pages, /etc/llumnix/llumnix.toml, the
# /etc/default/llumnix template and llumnixctl's bash completion. Idempotent; never overwrites an operator's
# llumnix.toml or /etc/default/llumnix. The Python side (the virtual environment) is scripts/install.sh's job.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/install-system.sh [--prefix DIR] [--venv PATH]

Install the Llumnix systemd units and their companions under DIR (default /):

  DIR/etc/systemd/system/          llumnix-manager.service, llumnix-proxy.service, llumnix-instance@.service
                                   (ExecStart= from PATH/bin)
  DIR/usr/lib/sysusers.d/          llumnix.conf: the system user llumnix the units run as
  DIR/usr/share/polkit-1/rules.d/  50-llumnix.rules: user llumnix may start/stop llumnix-instance@N
  DIR/usr/share/man/man{1,5,8}/    the man pages
  DIR/etc/llumnix/                 llumnix.toml.example, and llumnix.toml from it if there is none
  DIR/etc/default/llumnix          environment template (only if there is none)
  DIR/usr/share/bash-completion/completions/llumnixctl

Options:
  --prefix DIR   root of the installation (default /); a staging directory for packages or images
  --venv PATH    the virtual environment the units run (default /opt/llumnix/.venv)
  -h, --help     this text

With DIR=/ as root it then runs systemd-sysusers (creates the user) and, where systemd is running,
systemctl daemon-reload; otherwise it prints what to run. Running it again updates the units and man pages
and keeps llumnix.toml and /etc/default/llumnix as they are.
EOF
}

PREFIX=/
VENV=/opt/llumnix/.venv
while [ $# -gt 0 ]; do
  case $1 in
    --prefix) [ $# -ge 2 ] || { echo "install-system.sh: --prefix needs a directory" >&2; exit 2; }; PREFIX=$2; shift 2 ;;
    --prefix=*) PREFIX=${1#*=}; shift ;;
    --venv) [ $# -ge 2 ] || { echo "install-system.sh: --venv needs a path" >&2; exit 2; }; VENV=$2; shift 2 ;;
    --venv=*) VENV=${1#*=}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install-system.sh: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ -n "$PREFIX" ] || { echo "install-system.sh: --prefix must not be empty" >&2; exit 2; }
PREFIX=$(realpath -m -- "$PREFIX")
ROOT=${PREFIX%/}  # "" for /, so that paths read $ROOT/etc/...
VENV=${VENV%/}
case $VENV in
  /*) ;;
  *) echo "install-system.sh: --venv must be an absolute path (the units run it): $VENV" >&2; exit 2 ;;
esac
# The path goes into ExecStart= lines (unquoted, and one inside sh -c '...') and through sed.
if [[ $VENV =~ [^A-Za-z0-9/._+-] ]]; then
  echo "install-system.sh: --venv may hold only letters, digits and / . _ + - (it goes into unit files): $VENV" >&2
  exit 2
fi
if [ ! -x "$VENV/bin/llumnix-manager" ]; then
  echo "install-system.sh: note: $VENV/bin/llumnix-manager does not exist (yet); the units will run it from there" >&2
fi

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# put MODE SOURCE DEST: install SOURCE as DEST, replacing an older copy; says what it did.
put() {
  local mode=$1 src=$2 dest=$3 what
  if [ -f "$dest" ] && cmp -s "$src" "$dest"; then
    what=unchanged
    chmod "$mode" "$dest"
  else
    if [ -e "$dest" ]; then what=updated; else what=installed; fi
    install -D -m "$mode" "$src" "$dest"
  fi
  printf '%-10s %s\n' "$what" "$dest"
}

# keep MODE SOURCE DEST: install SOURCE as DEST only if there is no DEST (an operator's file stays as it is).
keep() {
  local mode=$1 src=$2 dest=$3
  if [ -e "$dest" ]; then
    printf '%-10s %s\n' kept "$dest (exists: not overwritten)"
  else
    install -D -m "$mode" "$src" "$dest"
    printf '%-10s %s\n' installed "$dest"
  fi
}

# Units: the ExecStart= paths point into the given venv.
for unit in llumnix-manager.service llumnix-proxy.service llumnix-instance@.service; do
  sed "s|/opt/llumnix/\.venv/bin/|$VENV/bin/|g" "$SRC/scripts/systemd/$unit" > "$TMP/$unit"
  put 0644 "$TMP/$unit" "$ROOT/etc/systemd/system/$unit"
done
put 0644 "$SRC/scripts/systemd/llumnix.sysusers.conf" "$ROOT/usr/lib/sysusers.d/llumnix.conf"
put 0644 "$SRC/scripts/systemd/llumnix.polkit.rules" "$ROOT/usr/share/polkit-1/rules.d/50-llumnix.rules"

# Man pages, by their section suffix.
for page in "$SRC"/man/*.[0-9]; do
  [ -f "$page" ] || continue
  name=$(basename "$page")
  put 0644 "$page" "$ROOT/usr/share/man/man${name##*.}/$name"
done

# Settings: the example is ours (updated); llumnix.toml and the environment file are the operator's.
put 0644 "$SRC/llumnix.toml.example" "$ROOT/etc/llumnix/llumnix.toml.example"
keep 0644 "$SRC/llumnix.toml.example" "$ROOT/etc/llumnix/llumnix.toml"
# 0600: it may hold HF_TOKEN; systemd reads it as root before the units start.
keep 0600 "$SRC/scripts/systemd/llumnix.default" "$ROOT/etc/default/llumnix"

# Bash completion, generated by llumnixctl itself (`completion bash` where it has that command, else typer's
# --show-completion), from the given venv or else the one of this source tree.
completion=$ROOT/usr/share/bash-completion/completions/llumnixctl
ctl=""
for c in "$VENV/bin/llumnixctl" "$SRC/.venv/bin/llumnixctl"; do
  if [ -x "$c" ]; then ctl=$c; break; fi
done
if [ -n "$ctl" ] && { "$ctl" completion bash > "$TMP/completion" 2>/dev/null ||
                      "$ctl" --show-completion bash > "$TMP/completion" 2>/dev/null; } &&
   grep -q 'complete ' "$TMP/completion"; then
  put 0644 "$TMP/completion" "$completion"
else
  printf '%-10s %s\n' skipped "$completion (no llumnixctl in $VENV/bin or $SRC/.venv/bin to generate it)"
fi

# The user, and systemd's view of the new units.
next=()
if [ -z "$ROOT" ] && [ "$(id -u)" = 0 ] && command -v systemd-sysusers >/dev/null 2>&1; then
  # Needs no running systemd: it only edits /etc/passwd and /etc/group (at boot systemd-sysusers.service would).
  systemd-sysusers /usr/lib/sysusers.d/llumnix.conf
  echo "ran        systemd-sysusers /usr/lib/sysusers.d/llumnix.conf (user $(id -un llumnix 2>/dev/null || echo llumnix))"
else
  next+=("systemd-sysusers /usr/lib/sysusers.d/llumnix.conf")
fi
if [ -z "$ROOT" ] && [ "$(id -u)" = 0 ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
  systemctl daemon-reload
  echo "ran        systemctl daemon-reload"
else
  next+=("systemctl daemon-reload")
fi
if [ ${#next[@]} -gt 0 ]; then
  if [ -n "$ROOT" ]; then echo "On the target system (installed under $PREFIX), run as root:"; else echo "Then run as root:"; fi
  for cmd in "${next[@]}"; do echo "  $cmd"; done
fi
echo "Next: edit /etc/llumnix/llumnix.toml (and /etc/default/llumnix), then e.g."
echo "  systemctl enable --now llumnix-manager llumnix-proxy llumnix-instance@0"
