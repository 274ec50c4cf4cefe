#!/usr/bin/env bash
# Packs what the GPU check (tests/gpu/check.py) runs on a machine with a GPU
# and no Rust toolchain: the `cellc` binary, the GPU test binaries, the
# Python wheel, stripped, with the cells, fixtures, Python tests and bench
# scripts they read, into one archive:
#
#     tests/gpu/pack.sh [ARCHIVE]        (default: target/gpu-pack/cellc-gpu.tar.gz)
#
# The test binaries look for the workspace where they were built; the check
# points them at the unpacked archive instead (CELLC_TEST_ROOT), and the
# manifest records the build-time root, commit and toolchain.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$(pwd)"
TARGET="${CARGO_TARGET_DIR:-target}"
ARCHIVE="${1:-$TARGET/gpu-pack/cellc-gpu.tar.gz}"
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
TESTS=(cuda_backend device_memory cuda_nvrtc)

echo "== cellc (release)"
cargo build --release --locked -p cellc-cli
mkdir -p "$STAGE/bin" "$STAGE/tests" "$STAGE/wheel"
cp "$TARGET/release/cellc" "$STAGE/bin/"

echo "== GPU test binaries: ${TESTS[*]}"
args=()
for t in "${TESTS[@]}"; do args+=(--test "$t"); done
cargo test --release --locked -p cellc-tests "${args[@]}" --no-run --message-format=json-render-diagnostics \
    >"$STAGE/build.json"
python3 - "$STAGE" "${TESTS[@]}" <<'EOF'
import json, shutil, sys
stage, wanted = sys.argv[1], set(sys.argv[2:])
found = {}
for line in open(f"{stage}/build.json"):
    msg = json.loads(line)
    if msg.get("reason") == "compiler-artifact" and msg.get("executable") and msg["target"]["name"] in wanted:
        found[msg["target"]["name"]] = msg["executable"]
missing = wanted - set(found)
if missing:
    sys.exit(f"no test binary for {sorted(missing)}")
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
cp benches/compare_pytorch.py benches/compare_pytorch_gpu.py benches/python_vs_nn.py "$STAGE/benches/"
cp tests/gpu/check.py "$STAGE/"
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
echo "== $ARCHIVE: $(du -h "$ARCHIVE" | cut -f1)"
tar -tzvf "$ARCHIVE" | awk '$3 > 1000000 {printf "  %6.1f MB  %s\n", $3 / 1e6, $6}'
