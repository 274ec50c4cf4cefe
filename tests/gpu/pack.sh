#!/usr/bin/env bash
# Packs what the GPU check (tests/gpu/check.py) runs on a machine with a GPU
# and no Rust toolchain: the `cellc` binary, the GPU test binaries, the
# Python wheel, stripped, with the cells, fixtures, Python tests, bench
# scripts and the check's own modules they read, into one archive:
#
#     tests/gpu/pack.sh [ARCHIVE]              (default: target/gpu-pack/cellc-gpu.tar.gz)
#     tests/gpu/pack.sh --dir FOLDER [ARCHIVE] the same, and its contents unpacked into FOLDER
#
# The binaries come from the workspace's release test build (the one
# `cargo test --workspace --release` makes, so nothing is built twice after
# it). The archive travels to the GPU machine inside the working tree, whose
# limit is 64 MiB: the script fails if the archive and the tracked files
# together come within 4 MiB of it.
#
# The test binaries look for the workspace where they were built; the check
# points them at the unpacked archive instead (CELLC_TEST_ROOT), and the
# manifest records the build-time root, commit and toolchain.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$(pwd)"
TARGET="${CARGO_TARGET_DIR:-target}"
DIR=""
if [ "${1:-}" = "--dir" ]; then
    DIR="$2"
    shift 2
fi
ARCHIVE="${1:-$TARGET/gpu-pack/cellc-gpu.tar.gz}"
LIMIT_MIB=64
MARGIN_MIB=4
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
TESTS=(cuda_backend device_memory cuda_nvrtc)

echo "== cellc and the GPU test binaries (${TESTS[*]}), from the workspace's release test build"
mkdir -p "$STAGE/bin" "$STAGE/tests" "$STAGE/wheel"
cargo test --workspace --release --locked --no-run --message-format=json-render-diagnostics >"$STAGE/build.json"
python3 - "$STAGE" "${TESTS[@]}" <<'EOF'
import json, shutil, sys
stage, wanted = sys.argv[1], set(sys.argv[2:])
found, cellc = {}, None
for line in open(f"{stage}/build.json"):
    msg = json.loads(line)
    if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
        continue
    target = msg["target"]
    if target["name"] in wanted and "test" in target["kind"]:
        found[target["name"]] = msg["executable"]
    # The program itself, not the bin target's own unit-test harness (also a "cellc" executable).
    if target["name"] == "cellc" and "bin" in target["kind"] and not msg["profile"]["test"]:
        cellc = msg["executable"]
missing = sorted(wanted - set(found)) + ([] if cellc else ["the cellc binary"])
if missing:
    sys.exit(f"not built: {missing}")
shutil.copy(cellc, f"{stage}/bin/cellc")
for name, exe in found.items():
    shutil.copy(exe, f"{stage}/tests/{name}")
EOF
rm "$STAGE/build.json"

echo "== Python wheel (abi3: any CPython 3.9+)"
python3 -m pip wheel --no-deps -q -w "$STAGE/wheel" ./runtime/python

strip "$STAGE/bin/cellc" "$STAGE"/tests/*

echo "== sources the check reads"
mkdir -p "$STAGE/runtime/python" "$STAGE/benches" "$STAGE/tests/fixtures"
cp -r cells "$STAGE/"
cp -r tests/fixtures/runtime "$STAGE/tests/fixtures/"
cp -r runtime/python/tests "$STAGE/runtime/python/"
cp benches/compare_pytorch.py benches/compare_pytorch_gpu.py "$STAGE/benches/"
cp tests/gpu/check.py tests/gpu/grid.py tests/gpu/measure.py tests/gpu/report.py "$STAGE/"
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
python3 - "$STAGE" "$ROOT" "${TESTS[@]}" <<'EOF'
import datetime, json, subprocess, sys
stage, root = sys.argv[1:3]
git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=root).stdout.strip()
manifest = {
    "built_from": root,
    "commit": git("rev-parse", "HEAD"),
    "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
    "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "rustc": subprocess.run(["rustc", "--version"], capture_output=True, text=True).stdout.strip(),
    "tests": sys.argv[3:],
}
json.dump(manifest, open(f"{stage}/manifest.json", "w"), indent=1)
EOF

mkdir -p "$(dirname "$ARCHIVE")"
tar -czf "$ARCHIVE.partial" -C "$STAGE" .
mv "$ARCHIVE.partial" "$ARCHIVE"
if [ -n "$DIR" ]; then
    mkdir -p "$DIR"
    cp -a "$STAGE/." "$DIR/"
    echo "== unpacked into $DIR"
fi
echo "== $ARCHIVE: $(du -h "$ARCHIVE" | cut -f1)"
tar -tzvf "$ARCHIVE" | awk '$3 > 1000000 {printf "  %6.1f MB  %s\n", $3 / 1e6, $6}'
python3 - "$ARCHIVE" "$LIMIT_MIB" "$MARGIN_MIB" <<'EOF'
import os, subprocess, sys
archive, limit, margin = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tracked = sum(os.path.getsize(p) for p in subprocess.run(["git", "ls-files", "-z"], capture_output=True,
              text=True).stdout.split("\0") if p and os.path.isfile(p))
total = (os.path.getsize(archive) + tracked) / 2**20
print(f"== travels to the GPU machine: {total:.1f} MiB (archive and tracked files; the limit is {limit} MiB)")
if total > limit - margin:
    sys.exit(f"the archive and the tracked files come to {total:.1f} MiB: within {margin} MiB of the {limit} MiB limit")
EOF
