#!/usr/bin/env bash
# Windows arm64 release job (Git Bash): make cargo and clang usable for building granian from
# its sdist (there is no win_arm64 wheel). The runner image ships rustup and LLVM; the `ring`
# crate needs clang for aarch64-pc-windows-msvc.
set -euo pipefail
if ! command -v rustup >/dev/null; then
    echo "::error::rustup is not on this runner; granian cannot be built for Windows arm64"
    exit 1
fi
rustup default stable
rustup target list --installed
llvm="/c/Program Files/LLVM/bin"
if [ -d "$llvm" ]; then
    cygpath -w "$llvm" >> "$GITHUB_PATH"
fi
cargo --version
