#!/bin/sh
# One-shot: create shoal's checkpoint bucket in the stack's MinIO (idempotent).
# Credentials come from the environment; mc never echoes the secret.
set -eu
bucket=${SHOAL_BUCKET:-shoal-checkpoints}
mc alias set shoal http://minio:9000 "$S3_ACCESS_KEY" "$S3_SECRET_KEY" >/dev/null
mc mb --ignore-existing "shoal/$bucket"
echo "minio-init: bucket $bucket ready"
