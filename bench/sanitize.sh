#!/usr/bin/env bash
# compute-sanitizer over the engine's kernels and the four KV modes, within one device call. Per tool
# two parts (memcheck: a third on request), each under its own time limit so that one slow part
# cannot eat the others:
#   kernels  bench/sanitize/cli.py: every Triton kernel entry of the engine (KernelSet),
#            launched from Python on requests of irregular lengths in both row formats, the device
#            synchronized after each launch; the findings are counted per entry in a table
#   churn    the overlap churn test (SANITIZE_TESTS, default tests/integration/test_engine_stress.py;
#            gpu cases): all four KV modes,
#            the service modes against a real kv_service process that the sanitizer follows too
#            (--target-processes all); tiny preset, CUDA graphs, cancels / stop tokens /
#            admissions at every step. STEPS is a minimum: the test goes on until every way out
#            (stop, length, cancel) was taken MIN_ENDS times, so a short run still covers them.
#   spec     memcheck only, opt-in (SANITIZE_SPEC=1: a third part; SANITIZE_SPEC=only: this
#            part alone): the speculative churn (tests/integration/test_engine_stress_speculative.py,
#            gpu cases): the same churn with --speculative mtp, D = 3, BENCHMARK-ONLY synthetic
#            acceptance 0.7,0.5,0.5 (0..3 drafts accepted: rollback at every depth), overlap and
#            micro-batches on, verify and draft CUDA graphs, all four KV modes; it goes on until
#            every depth was accepted too. Its own limit (MEMCHECK_SPEC_S) and per-mode table.
# Tools:
#   memcheck   out-of-bounds and misaligned global/shared accesses, errors of CUDA API calls
#   racecheck  shared-memory hazards inside a kernel (it instruments every kernel's shared
#              accesses, Triton's included; a kernel it cannot follow is named in its log); the
#              slowest tool: few churn steps
#   synccheck  invalid barrier and warp-sync use (what racecheck does not cover)
# Prints per tool and part the processes checked, the errors found, the exit status, the steps and
# seconds, then per tool the findings per kernel entry and per KV mode (the churn test prints a
# marker as each mode starts: what the sanitizer reports after it, service process included, is
# that mode's); logs go to $OUT (or ./.gpuout). Exit status 0 only if every part ran, found
# nothing, and passed, and every mode passed.
# Every process, the service the churn starts included, uses the CUDA tools that Triton resolves
# here before any sanitizer runs (TRITON_PTXAS_PATH...: kernels/toolchain.py): under
# --target-processes all the service once could not find ptxas.
# Fitting one 600 s device call (gpu_session.sh's SAN_S=570). Run N measured, at older settings:
# memcheck kernels 27 s (the Triton compile included), churn cut at 80 s in its 3rd mode;
# racecheck kernels 148 s (404 launches), churn cut at 130 s after 2 modes; synccheck 8 + 35 s.
# racecheck is the cost, and it grows with the work it instruments, not with set-up (synccheck's
# churn took under 9 s a mode, process starts and graph captures included). So:
#  - racecheck and synccheck run a one-layer model (`--layers 1`, STRESS_LAYERS=1, the service's
#    layout too): every kernel launches once per layer, with the layer a runtime argument, on the
#    same shapes; shared-memory hazards and barrier use follow the code path and the shape, which
#    the second layer repeats. That halves their launches (kernel pass: 202; on CPU, the same
#    entries, row formats, rows and contexts, only the layer index and the pools' layer dimension
#    differ). memcheck keeps both layers: an index past the last layer's rows shows only there.
#  - not "stop after K launches per entry": a run's new (entry, shapes) pairs keep coming until
#    its long request decodes past the hot buffer (launch 114 of 144 on CPU), so a cap by count
#    drops exactly the irregular sizes (misses, multi-tile contexts) the pass is for.
#  - memcheck's churn: 20 steps, each way out twice (about 32 steps a mode on CPU, 55 before):
#    every KV mode and way out still ends under it, and memcheck finds by path, not repetition.
#  - TRITON_CACHE_DIR is one directory for every part and child (the service's included): the
#    first part compiles, the rest load.
# H200, 2026-12-05 (seconds used / limit): memcheck kernels 23/40, churn 97/130 (4 modes passed,
# churn 14-19 s a mode, a service start 9-10 s); racecheck kernels 84/100, churn cut at 190 s
# after 2 modes: baseline engine build 5.9 + churn 75.5 s for 24 steps, embedded 8.3 + 66.8 s,
# and in a call of their own service 10.0 + 8.3 + 66.0 s, service-remote-swap 6.6 + 0.4 +
# 65.2 s (0 hazards); synccheck 8/25 + 34/50. ~2.8 s a racecheck step, and 24 steps a mode
# because random ends (1 in 32 tokens a stop, a cancel now and then, up to 23 tokens) took that
# long to take each way out once: ~330 s for its four modes, ~576 s in all. So:
#  - racecheck's churn plans its ends (STRESS_QUICK_ENDS=1, RACECHECK_QUICK_ENDS): requests in
#    turn are cancelled at their first token, stopped by half the vocabulary, or ended by length
#    after a prompt past the hot slots (its decode steps miss: swap-ins, remote swaps). On CPU
#    every way out is taken by step 8 in every mode (30 seeds; 11 to 81 steps at random), 9
#    steps a mode with the drain. The kernels, KV modes and ways out are the same; the test
#    fails if a mode with a host tier saw no miss. memcheck and synccheck keep random ends.
#  - estimate: racecheck's churn ~10 steps a mode (~28 s) + build / service start as measured
#    + pytest's start: ~170 s; in all 23 + 97 + 84 + ~170 + 8 + 34 = ~416 s. Limits 35 + 125,
#    100 + 200, 20 + 45 = 525 s (each part killed 5 s after its limit: 555 s at worst, under
#    570 s); the expected total leaves ~25% of 570 s, the slack where the guess is weakest
#    (racecheck's churn on the GPU). The modes table prints each mode's steps, seconds (service
#    start, engine build with graph capture, churn: the test's @@sanitize-time line) and its
#    ends per way out, and pytest --durations=0 each mode's total, for the next rebalance; the
#    churn row's steps read "the steps its modes ran, summed / STEPS" (a mode's minimum).
# H100, 2026-12-05 (run R, main 085e6df, seconds used / limit): memcheck kernels 21/35, churn
# 85/125 (4 modes passed, 25 steps each); racecheck kernels 83/100, churn 160/200 (4 modes
# passed, 9 planned-end steps each: 28-30 s of churn, service start 7-8 s); synccheck kernels
# 8/20, churn cut at 45 s in its 4th mode (service-remote-swap) after 3 passed: ~1 s of churn a
# mode, but a service start ~9 s and pytest's own start. The kernel pass exited 1 under every
# tool: linear, bmm, rms_norm and layer_norm (the --batch-invariant kernels) were never launched;
# bench/sanitize/cli.py now runs a batch-invariant engine too (~1/4 more launches). So the limits
# are now memcheck 35 + 110, racecheck 100 + 185, synccheck 20 + 70 = 520 s (550 s at worst with
# the 5 s kills, under 570); expected ~415 s.
# H100, 2026-12-06 (run T, main 2115f6e, cold Triton cache, seconds used / limit): memcheck
# kernels cut at 35/35 (before linear, bmm, rms_norm, layer_norm launched), churn 95/110;
# racecheck kernels 100/100 (its end marker printed, the exit not reached), churn 164/185;
# synccheck 9/20 + 31/70: 434 s, 0 findings anywhere, every mode passed, exit 1 for the two cut
# kernel parts. So an unsanitized warm-up compiles first (SANITIZE_WARM_S=40) and the limits are
# memcheck 45 + 110, racecheck 125 + 180, synccheck 20 + 50: 570 s with the warm-up at worst
# before the 5 s kills; expected ~475 s (the measured parts + the warm-up + racecheck's +1/4).
# H100, 2026-12-06 (run U4, seconds used / limit): warm-up 37, memcheck 26/45 + 91/110,
# racecheck 101/125 + 167/180, synccheck 11/20 + 35/50: 470 s, exit 0 (racecheck's churn has the
# least room). Run U1 lost synccheck's remote-swap mode to gRPC's fork handlers (the sanitizer
# follows children by fork): contract/grpc_fork.py.
# The speculative churn under memcheck (not run yet; estimate): on CPU its 20 steps / 2 ends take
# 29-31 steps a mode (16 prompt tokens a step; the plain churn's ~32), and a verify step
# launches ~2.5x a plain step's kernels (the 2 layers over D + 1 rows, then the MTP layer's
# block 3 times: over the rows, and 2 chained drafts; the acceptance eagerly). At memcheck's
# ~0.5 s a plain step (97 s for 4 modes above): ~40 s of churn a mode, + engine build with the
# draft graphs ~8 s, + a service start 10 s in the service modes, + the Triton compile ~15 s when
# it runs alone (SANITIZE_SPEC=only: no kernels part before it): ~230 s for the four modes.
# MEMCHECK_SPEC_S=280 by default (~20% slack); the default run (SANITIZE_SPEC=0) is unchanged:
#   SANITIZE_TOOLS=memcheck SANITIZE_SPEC=only SAN_S=300 bash bench/gpu_session.sh sanitize
#   SANITIZE_TOOLS=memcheck SANITIZE_SPEC=1 SAN_S=480 bash bench/gpu_session.sh sanitize
#     (kernels 35 + churn 110 + spec 280 s at worst, each part killed 5 s after its limit)
# If it runs out: SANITIZE_SPEC_K="gpu and (embedded or baseline)", then "gpu and service".
# Usage: bash bench/sanitize.sh
#        SANITIZE_TOOLS="memcheck" bash ...        a subset of the tools
#        SANITIZE_K="gpu and service" bash ...     some KV modes only (pytest -k)
#        SANITIZE_TESTS=tests/integration/test_shared_churn.py SANITIZE_TOOLS=memcheck bash ...
#            the churn part runs these test files' gpu cases (paths apart by spaces) instead of
#            the plain churn's
#            (default tests/integration/test_engine_stress.py): here the churn with shared
#            prefixes and the shared hot region on (issue 40; all four KV modes, STEPS and
#            MIN_ENDS as above). Not measured on a GPU yet: its first steps compile the shared
#            plan's kernels (engine and service), so give it room: MEMCHECK_CHURN_S=200
#        MEMCHECK_STEPS=20 MEMCHECK_MIN_ENDS=2     memcheck's churn
#        RACECHECK_STEPS=8 RACECHECK_MIN_ENDS=1 RACECHECK_QUICK_ENDS=1   racecheck's churn
#        SYNCCHECK_STEPS=8 SYNCCHECK_MIN_ENDS=1 SYNCCHECK_QUICK_ENDS=0   synccheck's churn
#            (MEMCHECK_QUICK_ENDS=0 likewise; 1: planned ends, see above)
#        MEMCHECK_LAYERS= RACECHECK_LAYERS=1 SYNCCHECK_LAYERS=1   model layers per tool (empty:
#            the preset's 2)
#        MEMCHECK_KERNELS_S=45 MEMCHECK_CHURN_S=110 time limits per tool and part (likewise
#            RACECHECK_*: 125, 180; SYNCCHECK_*: 20, 50; KERNELS_S / CHURN_S set every tool's),
#            each part killed 5 s after its limit
#        SANITIZE_SPEC=1|only MEMCHECK_SPEC_STEPS=20 MEMCHECK_SPEC_MIN_ENDS=2 MEMCHECK_SPEC_S=280
#            SANITIZE_SPEC_K="gpu"   memcheck's speculative churn (above), its KV modes (pytest -k)
#        SANITIZE_NO_CACHING=1 bash ...            the engine also bypasses torch's caching
#            allocator, so an access past a tensor inside a pooled block is caught too; its
#            steps then run eagerly (a graph capture must not cudaMalloc), the service keeps the
#            allocator (it exports CUDA IPC handles through it): see the test's docstring
set -uo pipefail
OUT=${OUT:-.gpuout}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
if [ "${SANITIZE_NO_CACHING:-0}" = 1 ]; then export PYTORCH_NO_CUDA_MEMORY_CACHING=1; fi
# Triton's default directory, named: every part and child compiles into and loads from one place.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-${HOME:-/tmp}/.triton/cache}
# The CUDA tools Triton finds outside any sanitizer, named for every process started below.
eval "$(python3 -c 'import triton; from kernels import toolchain
for k, v in toolchain.child_env().items(): print(f"export {k}={v}")')"
env | grep '^TRITON_.*_PATH=' || echo "Triton named no CUDA tool here"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -z "$SAN" ]; then echo "compute-sanitizer not found (CUDA toolkit bin/)"; exit 2; fi

# Errors a tool reported, over every process it followed.
count_errors() {
    local log=$1
    { grep -Eo "ERROR SUMMARY: [0-9]+ error" "$log" | awk '{print $3}'
      grep -Eo "RACECHECK SUMMARY: [0-9]+ hazards? displayed \([0-9]+ error" "$log" \
        | grep -Eo "\([0-9]+" | tr -d '('
    } | awk '{s += $1} END {print s + 0}'
}

status=0
rows=()
# The kernel pass once without any sanitizer, so that every part below loads compiled kernels
# instead of compiling under a tool. Run T (H100, cold Triton cache): memcheck's kernel part was
# cut at its 35 s limit before the batch-invariant entries had launched, and racecheck's reached
# its end marker at 100 s but not its exit. Its exit status is not a finding (a cache warmer only).
# SANITIZE_WARM=0 skips it; SANITIZE_WARM_S (40) bounds it.
if [ "${SANITIZE_WARM:-1}" = 1 ] && [ "${SANITIZE_SPEC:-0}" != only ]; then
  t0=$SECONDS
  timeout -k 5 "${SANITIZE_WARM_S:-40}" python3 -m bench.sanitize >"$OUT/sanitize_warm.log" 2>&1
  echo "--- warm-up, no sanitizer: rc=$? ($((SECONDS - t0)) s)"
fi
# One part under one tool: tool, part, steps, time limit, command... (its output is the log: the
# kernel table reads the sanitizer's lines between the driver's markers).
part() {
  local tool=$1 name=$2 steps=$3 limit=$4; shift 4
  local log="$OUT/sanitize_$tool.$name.log" t0=$SECONDS
  timeout -k 5 "$limit" "$SAN" --tool "$tool" --target-processes all "$@" >"$log" 2>&1
  local rc=$?
  local errors processes
  errors=$(count_errors "$log")
  processes=$(grep -Ec "(ERROR|RACECHECK) SUMMARY" "$log")
  if [ "$steps" != - ]; then  # the steps the modes ran, summed / the minimum a mode runs
    steps="$(grep -Eo '^@@sanitize-time .* steps [0-9]+' "$log" \
      | awk '{s += $NF} END {print s + 0}')/$steps"
  fi
  rows+=("$(printf '%-10s %-8s %10s %8s %6s %8s %6s' "$tool" "$name" "$processes" "$errors" \
    "$rc" "$steps" "$((SECONDS - t0))")")
  echo "--- $tool $name: rc=$rc errors=$errors ($((SECONDS - t0)) s)"
  tail -3 "$log" | sed 's/^/    /'
  if [ "$errors" != 0 ] || [ "$rc" != 0 ] || [ "$processes" = 0 ]; then status=1; fi
}

# A churn test's gpu cases under one tool: tool, part, steps, limit, test file, pytest -k; then
# its per-mode table. -s: the test's mode markers reach the log between the sanitizer's lines;
# -rA: a line per mode; --durations=0: each mode's seconds, set-up included.
churn() {
  local tool=$1 name=$2 steps=$3 limit=$4 file=$5 k=$6 table=modes
  [ "$name" = churn ] || table=$name-modes
  part "$tool" "$name" "$steps" "$limit" python3 -m pytest -q -s -rA --durations=0 -m gpu \
    -p no:cacheprovider --timeout 7200 $file -k "$k"  # $file: one or more paths
  python3 -m bench.sanitize --modes "$OUT/sanitize_$tool.$name.log" \
    >"$OUT/sanitize_$tool.$table.txt" 2>&1 || status=1
}

for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
  spec=0  # the speculative churn: memcheck's only (see above)
  rm -f "$OUT/sanitize_$tool".{table,modes,spec-modes}.txt  # the tables below are this run's
  case $tool in
    memcheck) steps=${MEMCHECK_STEPS:-20} ends=${MEMCHECK_MIN_ENDS:-2} layers=${MEMCHECK_LAYERS-}
      quick=${MEMCHECK_QUICK_ENDS:-0} spec=${SANITIZE_SPEC:-0}
      kernels_s=${MEMCHECK_KERNELS_S:-${KERNELS_S:-45}}
      churn_s=${MEMCHECK_CHURN_S:-${CHURN_S:-110}} ;;
    racecheck) steps=${RACECHECK_STEPS:-8} ends=${RACECHECK_MIN_ENDS:-1}
      layers=${RACECHECK_LAYERS-1} quick=${RACECHECK_QUICK_ENDS:-1}
      kernels_s=${RACECHECK_KERNELS_S:-${KERNELS_S:-125}}
      churn_s=${RACECHECK_CHURN_S:-${CHURN_S:-180}} ;;
    *) steps=${SYNCCHECK_STEPS:-8} ends=${SYNCCHECK_MIN_ENDS:-1} layers=${SYNCCHECK_LAYERS-1}
      quick=${SYNCCHECK_QUICK_ENDS:-0}
      kernels_s=${SYNCCHECK_KERNELS_S:-${KERNELS_S:-20}}
      churn_s=${SYNCCHECK_CHURN_S:-${CHURN_S:-50}} ;;
  esac
  if [ "$spec" != only ]; then
    part "$tool" kernels - "$kernels_s" python3 -m bench.sanitize ${layers:+--layers "$layers"}
    python3 -m bench.sanitize --table "$OUT/sanitize_$tool.kernels.log" \
      >"$OUT/sanitize_$tool.table.txt" 2>&1 || status=1
    # read by the test
    export STRESS_STEPS=$steps STRESS_MIN_ENDS=$ends STRESS_LAYERS=$layers STRESS_QUICK_ENDS=$quick
    churn "$tool" churn "$steps" "$churn_s" \
      "${SANITIZE_TESTS:-tests/integration/test_engine_stress.py}" "${SANITIZE_K:-gpu}"
  fi
  if [ "$spec" != 0 ]; then
    spec_steps=${MEMCHECK_SPEC_STEPS:-20}
    export STRESS_STEPS=$spec_steps STRESS_MIN_ENDS=${MEMCHECK_SPEC_MIN_ENDS:-2} \
      STRESS_LAYERS=$layers STRESS_QUICK_ENDS=0
    churn "$tool" spec "$spec_steps" "${MEMCHECK_SPEC_S:-280}" \
      tests/integration/test_engine_stress_speculative.py "${SANITIZE_SPEC_K:-gpu}"
  fi
done

echo
printf '%-10s %-8s %10s %8s %6s %8s %6s\n' tool part processes errors rc steps secs
printf '%s\n' "${rows[@]}"
for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
  for f in table modes spec-modes; do
    [ -f "$OUT/sanitize_$tool.$f.txt" ] || continue
    echo
    case $f in
      table) echo "$tool: findings per kernel entry" ;;
      modes) echo "$tool: findings per KV mode (churn)" ;;
      *) echo "$tool: findings per KV mode (speculative churn, SANITIZE_SPEC)" ;;
    esac
    sed 's/^/    /' "$OUT/sanitize_$tool.$f.txt"
  done
done
exit $status
