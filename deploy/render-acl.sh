#!/bin/sh
# Render deploy/users.acl.template into an ACL file with SHA-256 password hashes.
#
#   REDIS_PASSWORD=... REDIS_WORKER_DIGITS_PASSWORD=... sh deploy/render-acl.sh deploy/users.acl
#
# Passwords are read from the environment only, never from arguments (so they do not show
# in `ps`), and never printed. The output file is created mode 600.
set -eu
out=${1:?usage: render-acl.sh OUTPUT_FILE}
here=$(dirname "$0")
: "${REDIS_PASSWORD:?set REDIS_PASSWORD}"
: "${REDIS_WORKER_DIGITS_PASSWORD:?set REDIS_WORKER_DIGITS_PASSWORD}"

sha() { printf '%s' "$1" | sha256sum | cut -d' ' -f1; }

default_hash=$(sha "$REDIS_PASSWORD")
worker_hash=$(sha "$REDIS_WORKER_DIGITS_PASSWORD")
umask 077
sed -e "s/@DEFAULT_PASSWORD_SHA256@/$default_hash/" \
    -e "s/@WORKER_DIGITS_PASSWORD_SHA256@/$worker_hash/" \
    "$here/users.acl.template" | grep -v '^#' > "$out"
echo "render-acl: wrote $out"
