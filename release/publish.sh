#!/usr/bin/env bash
# The release job's last step: create the GitHub release for TAG with every binary, SHA256SUMS,
# release-manifest.json (written and verified by the `manifest` job), the wheels, and NOTES
# (release/notes.py: the CHANGELOG.md section of the version) as its text.
#   bash release/publish.sh TAG ASSETS_DIR WHEELS_DIR NOTES   (needs GH_TOKEN and GITHUB_REPOSITORY)
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:?usage: release/publish.sh TAG ASSETS_DIR WHEELS_DIR NOTES}
assets=${2:?}
wheels=${3:?}
notes=${4:?}
python3 release/manifest.py check-tag "$tag"
python3 release/manifest.py verify "$assets" --require-all
files=("$assets"/* "$wheels"/*)
gh release create "$tag" "${files[@]}" \
    --repo "$GITHUB_REPOSITORY" \
    --verify-tag \
    --title "nulltickets ${tag#v}" \
    --notes-file "$notes"
