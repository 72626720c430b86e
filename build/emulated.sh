#!/usr/bin/env bash
# A Linux release binary for another architecture, built and tested under QEMU user emulation:
#
#   bash build/emulated.sh ARCH [--rootfs-only | --e2e-only]      ARCH = aarch64 | riscv64
#
# 1. rootfs:   a Debian (trixie) root filesystem for ARCH, made by debootstrap from the
#              distribution's packages (--foreign, then the second stage under qemu-user-static
#              through binfmt_misc), cached in $NULLTICKETS_EMULATED_DIR/ARCH and reused later;
# 2. packages: the build's tools from Debian inside it (Python 3.13, patchelf; on riscv64 also
#              autotools and libffi for uvloop and zstandard, which have no wheels);
#    cross:    the compilers, natively: a root filesystem of the host's architecture with
#              Debian's cross gcc for ARCH (and on riscv64 the host's rustc and cargo for
#              granian), mounted in at /opt/cross, then checked (cross_toolchain, cross_check);
# 3. source:   the repository's files (tracked and new, not ignored ones) copied into it (the
#              release venv from an earlier run kept: its apsw is reused when it verifies);
# 4. release:  build/release.sh, the very script every release job runs (apsw from its sdist
#              against vendor/sqlite, Nuitka onefile, build/smoke.py);
# 5. e2e:      the agent-contract e2e tests (AGENT_CONTRACT_TESTS below) against that binary;
# 6. output:   dist/nulltickets-linux-ARCH.bin (+ .build.json) copied back, checked with `file`.
#
# --rootfs-only stops after step 2 and the compilers; --e2e-only runs steps 5 and 6 again on the last build, with
# the repository's tests/ copied in afresh.
#
# Every step prints its name and its elapsed seconds ("== step NAME: N s"), and everything goes
# to $NULLTICKETS_EMULATED_DIR/ARCH.log as well. Needs root (debootstrap, chroot, mounts) and
# apt-get; installs debootstrap, qemu-user-static and binfmt-support on the host when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
arch=${1:?usage: build/emulated.sh aarch64|riscv64 [--rootfs-only|--e2e-only]}
mode=${2:-}
case $arch in
    aarch64) deb_arch=arm64 target_elf="ARM aarch64" rust_target=aarch64-unknown-linux-gnu ;;
    riscv64) deb_arch=riscv64 target_elf="RISC-V" rust_target=riscv64gc-unknown-linux-gnu ;;
    *) echo "usage: build/emulated.sh aarch64|riscv64" >&2; exit 2 ;;
esac
triplet=$arch-linux-gnu
suite=${NULLTICKETS_EMULATED_SUITE:-trixie}
mirror=${NULLTICKETS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
work=${NULLTICKETS_EMULATED_DIR:-/var/tmp/nulltickets-emulated}
root=$work/$arch
log=$work/$arch.log
mkdir -p "$work"
exec > >(tee -a "$log") 2>&1

# The e2e suite's agent-contract tests: what nullhub and agents depend on. test_nullhub.py is
# the nullhub contract (manifest, health, discovery, the calls nullhub makes); test_claims.py
# and test_runs.py are the claim -> run -> transition/fail loop every agent runs, leases and
# idempotency included; test_sqlite_report.py checks the binary reports vendor/sqlite. The rest of tests/e2e (long polls, slow clients, concurrency, traces)
# is run against the native binary by `make test-binary`; under emulation it would take hours
# and time out on nothing but the emulator's speed.
AGENT_CONTRACT_TESTS="tests/e2e/test_nullhub.py tests/e2e/test_claims.py tests/e2e/test_runs.py"
AGENT_CONTRACT_TESTS+=" tests/e2e/test_sqlite_report.py"

# ccache: Nuitka compiles through it when it is on PATH; the cache stays in the root filesystem,
# so a later build recompiles only the modules whose C changed.
packages="python3 python3-venv python3-dev patchelf file ca-certificates ccache"
# The compilers: by default Debian's cross compilers for ARCH, running natively on the host (see
# cross_toolchain below), so compiling runs at native speed while everything else runs emulated.
# NULLTICKETS_EMULATED_CC=native installs the target's own gcc (and on riscv64 rustc) instead:
# every compilation emulated, hours longer.
cc_mode=${NULLTICKETS_EMULATED_CC:-cross}
case $cc_mode in
    cross) packages+=" libc6-dev make" ;;
    native) packages+=" build-essential" ;;
    *) echo "NULLTICKETS_EMULATED_CC is cross or native, not $cc_mode" >&2; exit 2 ;;
esac
if [ "$arch" = riscv64 ]; then
    # granian, uvloop and zstandard have no riscv64 wheels: cargo for granian, autotools for
    # uvloop's bundled libuv. rustc and cargo are the target's own when every compiler is, else
    # the host's (cross_toolchain).
    # libffi-dev: cffi, a build dependency of zstandard, has no riscv64 wheel either.
    packages+=" autoconf automake libtool pkg-config libffi-dev"
    if [ "$cc_mode" = native ]; then packages+=" rustc cargo"; fi
fi

script_started=$(date +%s)
step() {
    local name=$1 started
    shift
    started=$(date +%s)
    echo "== step $name: started $(date -u +%H:%M:%S)"
    "$@"
    echo "== step $name: $(($(date +%s) - started)) s"
}

mounted=()
cleanup() {
    local m
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
        m=${mounted[i]}
        umount -l "$m" 2>/dev/null || true
    done
}
trap cleanup EXIT
trap 'exit 143' TERM INT
mount_into() { # SOURCE TARGET [mount args...]
    local target=$root$2
    mkdir -p "$target"
    mountpoint -q "$target" && umount -l "$target"
    mount "${@:3}" "$1" "$target"
    mounted+=("$target")
}

host_tools() {
    # debian-archive-keyring: debootstrap checks the Release signature with it (an Ubuntu
    # host, such as the release job's runner, lacks it by default).
    if ! command -v debootstrap >/dev/null || ! [ -e /usr/bin/qemu-$arch-static ] \
        || ! command -v update-binfmts >/dev/null \
        || ! [ -e /usr/share/keyrings/debian-archive-keyring.gpg ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            debootstrap qemu-user-static binfmt-support debian-archive-keyring
    fi
    if ! mountpoint -q /proc/sys/fs/binfmt_misc; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    fi
    update-binfmts --enable "qemu-$arch" 2>/dev/null || true
    grep -q '^enabled' "/proc/sys/fs/binfmt_misc/qemu-$arch" \
        || { echo "binfmt_misc has no enabled qemu-$arch entry" >&2; exit 1; }
    qemu-$arch-static --version | head -1
}

rootfs() {
    if [ -e "$root/.nulltickets-rootfs-done" ]; then
        echo "reusing $root ($(cat "$root/.nulltickets-rootfs-done"))"
        return
    fi
    rm -rf "$root"
    mkdir -p "$root"
    debootstrap --foreign --arch="$deb_arch" --variant=minbase \
        --keyring=/usr/share/keyrings/debian-archive-keyring.gpg \
        --include=ca-certificates "$suite" "$root" "$mirror"
    # The second stage runs the target's own binaries: qemu-user-static through binfmt_misc.
    chroot "$root" /debootstrap/debootstrap --second-stage
    echo "$suite $deb_arch $(date -u +%FT%TZ)" > "$root/.nulltickets-rootfs-done"
}

# The host's trusted certificates go along (a host whose HTTPS passes through an inspecting
# proxy trusts its certificate there, and pip and urllib inside must too); where there is none,
# the root filesystem's own ca-certificates bundle.
host_ca=/etc/ssl/certs/ca-certificates.crt
ca=/etc/ssl/certs/ca-certificates.crt
enter() { # run a command inside the root filesystem with a clean environment
    env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
        LANG=C.UTF-8 TERM=dumb DEBIAN_FRONTEND=noninteractive \
        SSL_CERT_FILE="$ca" PIP_CERT="$ca" REQUESTS_CA_BUNDLE="$ca" "${@:2}" \
        chroot "$root" bash -euo pipefail -c "$1"
}

mounts() {
    cp /etc/resolv.conf "$root/etc/resolv.conf"
    if [ -f "$host_ca" ]; then
        cp "$host_ca" "$root/etc/ssl/host-ca-certificates.crt"
        ca=/etc/ssl/host-ca-certificates.crt
    fi
    mount_into /proc /proc -t proc
    mount_into /sys /sys --rbind
    mount_into /dev /dev --rbind
    mount_into tmpfs /dev/shm -t tmpfs
    mount_into tmpfs /tmp -t tmpfs
}

packages() {
    enter "apt-get update -qq && apt-get install -y -qq --no-install-recommends $packages \
        && python3 --version && { cargo --version 2>/dev/null || true; }"
}

# The cross toolchain (cc_mode cross): Debian's cross compilers for the target, which run on
# the host, in a root filesystem of the host's own architecture ($work/toolchain-amd64, made by
# debootstrap natively in under a minute and shared by every target). Mounted into the target's root
# filesystem at /opt/cross, with the host's libraries at their multiarch path
# (/usr/lib/x86_64-linux-gnu, where the target has nothing) and the host's dynamic loader, its
# programs run there natively. The cross gcc looks for the target's headers and libraries under
# its own prefix (Debian's *-cross packages of the same glibc) and then at the target's
# multiarch paths (/usr/include/TRIPLET, /usr/lib/TRIPLET), which in the target's root
# filesystem hold its own packages (Python's headers and libpython among them), so it makes
# what the target's own gcc would. gcc, cc and TRIPLET-gcc (the name in Python's build
# configuration, which setuptools calls) in /usr/local/bin point at it. On riscv64, granian is
# Rust: the host's rustc and cargo with the target's standard library (libstd-rust-dev:riscv64),
# and release() points cargo at the target; build scripts and procedural macros are built for
# the host and run natively. Only the compilers run natively: Python, pip, maturin, Nuitka's own
# work, the binary and its tests all run under QEMU.
toolchain=$work/toolchain-amd64
cross_packages() {
    local list="gcc-$triplet g++-$triplet"
    if [ "$arch" = riscv64 ]; then
        # librust-pyo3-dev: the crates of cross_check's Rust extension (build/pyo3-check).
        list+=" rustc cargo gcc libc6-dev libstd-rust-dev:$deb_arch librust-pyo3-dev"
    fi
    echo "$list"
}

cross_toolchain() {
    [ "$(uname -m)" = x86_64 ] \
        || { echo "the cross toolchain needs an x86_64 host (NULLTICKETS_EMULATED_CC=native)" >&2; exit 1; }
    if ! [ -e "$toolchain/.nulltickets-rootfs-done" ]; then
        rm -rf "$toolchain"
        debootstrap --variant=minbase --keyring=/usr/share/keyrings/debian-archive-keyring.gpg \
            --include=ca-certificates "$suite" "$toolchain" "$mirror"
        echo "$suite amd64 $(date -u +%FT%TZ)" > "$toolchain/.nulltickets-rootfs-done"
    fi
    cp /etc/resolv.conf "$toolchain/etc/resolv.conf"
    local tca=/etc/ssl/certs/ca-certificates.crt
    if [ -f "$host_ca" ]; then
        mkdir -p "$toolchain/etc/ssl"
        cp "$host_ca" "$toolchain/etc/ssl/host-ca-certificates.crt"
        tca=/etc/ssl/host-ca-certificates.crt
    fi
    env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
        DEBIAN_FRONTEND=noninteractive SSL_CERT_FILE="$tca" \
        chroot "$toolchain" bash -euo pipefail -c "dpkg --add-architecture $deb_arch \
            && apt-get update -qq \
            && apt-get install -y -qq --no-install-recommends $(cross_packages)"
    if [ "$arch" = riscv64 ]; then
        # The host's gcc links cargo's build scripts. It looks for ld and as in its tool
        # directory before PATH, and must find the host's there: the target's root filesystem
        # has its own binutils on PATH (libtool, for uvloop's libuv, brings in the target's gcc).
        mkdir -p "$toolchain/usr/x86_64-linux-gnu/bin"
        local tool
        for tool in ld as; do
            ln -sf "../../bin/x86_64-linux-gnu-$tool" "$toolchain/usr/x86_64-linux-gnu/bin/$tool"
        done
    fi
}

cross_mounts() {
    mkdir -p "$root/opt/cross" "$root/usr/lib/x86_64-linux-gnu" "$root/usr/lib64"
    [ -e "$root/lib64" ] || ln -s usr/lib64 "$root/lib64"
    mount_into "$toolchain" /opt/cross --bind -o ro
    mount_into "$toolchain/usr/lib/x86_64-linux-gnu" /usr/lib/x86_64-linux-gnu --bind -o ro
    mount_into "$toolchain/usr/lib64" /usr/lib64 --bind -o ro
    # The cross gcc's own libc (Debian's *-cross packages: the same glibc as the target's) names
    # its files by absolute paths under /usr/TRIPLET in its linker scripts.
    # (Tested as a link, not followed: from the host, /opt/cross is not where it points.)
    if [ -L "$root/usr/$triplet" ] || ! [ -e "$root/usr/$triplet" ]; then
        ln -sfn "/opt/cross/usr/$triplet" "$root/usr/$triplet"
    fi
    local name
    for name in gcc cc "$triplet-gcc"; do
        ln -sf "/opt/cross/usr/bin/$triplet-gcc" "$root/usr/local/bin/$name"
    done
    for name in g++ c++ "$triplet-g++"; do
        ln -sf "/opt/cross/usr/bin/$triplet-g++" "$root/usr/local/bin/$name"
    done
    # The binutils programs that builds call by their plain names (Nuitka needs readelf to find
    # the libraries each extension module links), the cross ones: no native binutils here.
    for name in readelf objdump objcopy strip nm ar ranlib; do
        ln -sf "/opt/cross/usr/bin/$triplet-$name" "$root/usr/local/bin/$name"
    done
    if [ "$arch" = riscv64 ]; then
        for name in rustc cargo x86_64-linux-gnu-gcc; do
            ln -sf "/opt/cross/usr/bin/$name" "$root/usr/local/bin/$name"
        done
        # rustc finds its standard libraries from where librustc_driver is, and that is
        # /usr/lib/x86_64-linux-gnu here: /usr/lib/rustlib must be the toolchain's.
        if [ -d "$root/usr/lib/rustlib" ] && ! [ -L "$root/usr/lib/rustlib" ]; then
            echo "$root has Rust libraries of its own: remove rustc and libstd-rust-dev there" >&2
            exit 1
        fi
        ln -sfn /opt/cross/usr/lib/rustlib "$root/usr/lib/rustlib"
    fi
}

# cargo for the target with the cross gcc as its linker, and for the host (build scripts,
# procedural macros) with the host's; pyo3 reads the target Python's configuration.
cross_cargo_env() {
    local target_var=${rust_target^^}
    target_var=${target_var//-/_}
    echo CARGO_BUILD_TARGET="$rust_target" "CARGO_TARGET_${target_var}_LINKER=$triplet-gcc" \
        CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER=x86_64-linux-gnu-gcc \
        PYO3_CROSS_LIB_DIR=/usr/lib/python3.13
}

# A program that embeds Python, built with the cross gcc inside the root filesystem, must run
# there and be the target's; gcc itself must be the host's. On riscv64, a Rust extension
# (build/pyo3-check, pyo3 only, its crates from Debian so that the check runs offline) is built
# by pip and maturin exactly as granian is, then imported under emulation: it must say riscv64.
cross_check() {
    enter "printf '#include <Python.h>\nint main(void) { return Py_IsInitialized(); }\n' \
            > /tmp/cc-check.c \
        && gcc \$(python3-config --includes) /tmp/cc-check.c -o /tmp/cc-check \
            \$(python3-config --ldflags --embed) \
        && /tmp/cc-check && readelf --dynamic /tmp/cc-check | grep -q NEEDED"
    file -L "$root$(chroot "$root" readlink -f /usr/local/bin/gcc)" | grep -q "x86-64" \
        || { echo "gcc in the root filesystem is not the host's" >&2; exit 1; }
    file "$root/tmp/cc-check" | grep -q "$target_elf" \
        || { echo "the cross gcc did not make a $arch program" >&2; exit 1; }
    if [ "$arch" = riscv64 ]; then
        rm -rf "$root/tmp/pyo3-check"
        cp -r "$repo/build/pyo3-check" "$root/tmp/pyo3-check"
        # shellcheck disable=SC2046 # one word per variable
        enter "rustc --version && cd /tmp/pyo3-check && python3 -m venv /tmp/pyo3-venv \
            && /tmp/pyo3-venv/bin/python -m pip install --quiet . \
            && cd / && /tmp/pyo3-venv/bin/python -c 'import pyo3_check; print(pyo3_check.arch())' \
                > /tmp/pyo3-check.out" $(cross_cargo_env)
        grep -qx "$arch" "$root/tmp/pyo3-check.out" \
            || { echo "the Rust extension is not a $arch one" >&2; exit 1; }
        echo "Rust extension (pyo3, maturin) built for $(cat "$root/tmp/pyo3-check.out")"
    fi
}

copy_source() {
    # The release venv stays: its apsw, built from the sdist (minutes with the cross gcc, hours
    # with NULLTICKETS_EMULATED_CC=native), is reused when it still verifies as ours
    # (build/build_apsw.py); everything else is fresh.
    mkdir -p "$root/src"
    find "$root/src" -mindepth 1 -maxdepth 1 ! -name .venv-release -exec rm -rf {} +
    git -c safe.directory="$repo" -C "$repo" ls-files -z --cached --others --exclude-standard \
        | (cd "$repo" && tar --null -T - -cf -) | tar -xf - -C "$root/src"
    git -c safe.directory="$repo" -C "$repo" log -1 --format='source: %h %s' || true
    if [ -n "$(git -c safe.directory="$repo" -C "$repo" status --porcelain)" ]; then
        echo "source: with uncommitted changes"
    fi
}

tests_only() {
    [ -x "$root/src/dist/nulltickets-linux-$arch.bin" ] \
        || { echo "no build in $root/src: run build/emulated.sh $arch first" >&2; exit 1; }
    rm -rf "$root/src/tests"
    git -c safe.directory="$repo" -C "$repo" ls-files -z --cached --others --exclude-standard tests \
        | (cd "$repo" && tar --null -T - -cf -) | tar -xf - -C "$root/src"
    git -c safe.directory="$repo" -C "$repo" log -1 --format='tests: %h %s' || true
}

release() {
    local from_source=""
    [ "$arch" = riscv64 ] && from_source="granian uvloop zstandard"
    # Emulated start-up is slow (every instruction is translated): the smoke test waits longer.
    # No LTO: gcc's link-time pass over the whole program, emulated, outlasts the compilation
    # itself (measured: still linking after the 150 modules had compiled in 23 minutes).
    local cross_env=()
    if [ "$cc_mode" = cross ] && [ "$arch" = riscv64 ]; then
        read -r -a cross_env <<< "$(cross_cargo_env)"
    fi
    enter "cd /src && bash build/release.sh python3" "${cross_env[@]}" \
        NULLTICKETS_FROM_SOURCE="$from_source" \
        NULLTICKETS_SMOKE_ARGS="--timeout 600" \
        NULLTICKETS_BUILD_ARGS="${NULLTICKETS_BUILD_ARGS:---lto=no}"
}

e2e() {
    # pytest into the release venv (which has the package: the tests import it to compute
    # expectations); every request goes to the binary.
    enter "cd /src && .venv-release/bin/python -m pip install --quiet pytest==9.2.0 \
        pytest-timeout==2.4.0 && export XDG_CACHE_HOME=/src/dist/onefile-cache \
        NULLTICKETS_BINARY=/src/dist/nulltickets-linux-$arch.bin \
        NULLTICKETS_TEST_TIME_SCALE=20 && \
        .venv-release/bin/python -m pytest -p no:cacheprovider --timeout 3600 \
        $AGENT_CONTRACT_TESTS ${NULLTICKETS_E2E_ARGS:-}"
}

output() {
    mkdir -p "$repo/dist"
    cp "$root/src/dist/nulltickets-linux-$arch.bin" "$root/src/dist/nulltickets-linux-$arch.bin.build.json" \
        "$repo/dist/"
    file "$repo/dist/nulltickets-linux-$arch.bin"
    file "$repo/dist/nulltickets-linux-$arch.bin" | grep -q "ELF 64-bit.*$target_elf" \
        || { echo "dist/nulltickets-linux-$arch.bin is not a $arch ELF" >&2; exit 1; }
    ls -l "$repo/dist/nulltickets-linux-$arch.bin"
}

echo "== build/emulated.sh $arch ($suite, $deb_arch) at $(date -u +%FT%TZ) in $root"
step host-tools host_tools
step rootfs rootfs
step mounts mounts
step packages packages
if [ "$cc_mode" = cross ]; then
    step cross-toolchain cross_toolchain
    step cross-mounts cross_mounts
    step cross-check cross_check
fi
if [ "$mode" = --rootfs-only ]; then
    echo "== done (rootfs only): $(($(date +%s) - script_started)) s"
    exit 0
fi
if [ "$mode" = --e2e-only ]; then
    step tests tests_only
    step e2e e2e
    step output output
    echo "== done (e2e only): $(($(date +%s) - script_started)) s"
    exit 0
fi
step source copy_source
step release release
step e2e e2e
step output output
echo "== done: $(($(date +%s) - script_started)) s"
