#!/bin/sh
# One-shot check run by the `preflight` service before anything else in compose.yaml starts.
# Refuses placeholder or unusable credentials from .env. Names the variable, never its value.
# Kubernetes runs it too (an init container of Redis and MinIO, deploy/k8s), naming its
# Secret instead of .env through the three SHOAL_CREDENTIALS_* variables.
set -u
source=${SHOAL_CREDENTIALS_SOURCE:-.env}
template=${SHOAL_CREDENTIALS_TEMPLATE:-deploy/env.example}
hint=${SHOAL_CREDENTIALS_HINT:-copy deploy/env.example to .env and fill it in}
fail=0
bad() { echo "shoal: $1" >&2; fail=1; }

check() {  # check NAME MIN_LENGTH
    name=$1 min=$2
    eval "value=\${$name-}"
    case "$value" in
        "") bad "$name is not set: $hint"; return ;;
        change-me*) bad "$name in $source is still the placeholder from $template: replace it" ;;
    esac
    if [ "${#value}" -lt "$min" ]; then
        bad "$name must be at least $min characters"
    fi
}

check REDIS_PASSWORD 16
check S3_ACCESS_KEY 3
check S3_SECRET_KEY 8
case "${REDIS_PASSWORD-}" in
    *[!A-Za-z0-9._~-]*) bad "REDIS_PASSWORD goes into REDIS_URL: use only letters, digits, '.', '_', '~', '-' (e.g. openssl rand -hex 32)" ;;
esac

if [ "$fail" -ne 0 ]; then
    exit 1
fi
echo "preflight: credentials set"
