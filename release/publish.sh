#!/usr/bin/env bash
# The release job's last step: create the GitHub release for TAG with every binary, SHA256SUMS,
# release-manifest.json (already verified by release/manifest.py verify) and the wheels.
#   bash release/publish.sh TAG ASSETS_DIR WHEELS_DIR      (needs GH_TOKEN and GITHUB_REPOSITORY)
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:?usage: release/publish.sh TAG ASSETS_DIR WHEELS_DIR}
assets=${2:?}
wheels=${3:?}
python3 release/manifest.py check-tag "$tag"
python3 release/manifest.py verify "$assets"
files=("$assets"/* "$wheels"/*)
gh release create "$tag" "${files[@]}" \
    --repo "$GITHUB_REPOSITORY" \
    --verify-tag \
    --title "nulltickets ${tag#v}" \
    --notes "Standalone executables for nullhub (nulltickets-<os>-<arch>.bin, .exe on Windows), their SHA256SUMS and release-manifest.json, and the Python wheels. Verify a download with: sha256sum --check --ignore-missing SHA256SUMS"
