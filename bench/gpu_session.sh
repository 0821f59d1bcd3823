#!/usr/bin/env bash
# One device call that batches this session's GPU work. Each stage has its own time limit, so
# one slow stage cannot eat the others. Every log and JSON goes to $OUT/run/, packed at the end
# into $OUT/run.tgz (the device tool returns at most 8 files); $OUT/summary.txt is the table
# (run-2.tgz, summary-2.txt, ... for a later invocation in the same call).
# Usage: bash bench/gpu_session.sh [stage ...]
#   stages: host hostgather hostnode tests sanitize kernels sweep profiles ncu copysweep e2e mtp prefix gateway disagg
#   wire ncuattn
#   host (HOST_S=45): the miss copy alone on this machine (bench/kernels/copy_span.py), first in
#   every session: two H100 machines of one kind moved it at 22 and 45 GB/s (run AA), so every
#   copy and e2e figure needs it beside
#   hostgather (HG_S=90, HG_ARGS="--threads 4,8,16 --chunks 1,4,8"): a part's misses through a
#   host gather and the copy engine against the SM copy, alone and beside a GEMM and the mix pass
#   hostnode (HN_S=60, HN_ARGS="--staged 24M:2:8"): the engine's staged copy in a graph vs its SM copy
#   TESTS="tests/x.py ..."  TEST_M="gpu" (pytest -m)  TEST_K="pytest -k expr"  TEST_S=300
#   TEST_N=4 (pytest-xdist workers: every GPU test in ~120 s instead of 320-400 s, run Q; on a
#   fresh machine, whose Triton cache is cold, 186 tests took over 210 s on an H100, run S)
#   TEST_TIMEOUT=150  SAN_S=570 (compute-sanitizer memcheck, racecheck, synccheck over every
#   kernel entry and the churn test in all four KV modes; SANITIZE_TOOLS picks, sanitize.sh's
#   own settings pass through: *_STEPS, *_MIN_ENDS, *_KERNELS_S, *_CHURN_S per tool;
#   SANITIZE_SPEC=1|only adds memcheck's speculative churn, MEMCHECK_SPEC_S=280)
#   KERN_S=100  KERNEL_CASES=miss_copy,attention (empty: all)  KERNEL_QUICK=--quick (empty: full)
#   SWEEP_S=150  SWEEP_ARGS="--batches 8,64,128"
#   PROF_S=60 (each)  PROFILES="bf16:128:1 bf16:128:2" (row format:batch:micro-batches[:args,
#   comma-separated, e.g. fp8:222:2:--copy-chunk=16384, fp8:222:2:--copy-priority=-1 or
#   fp8:222:2:--decode-part-tail,--skip-copy; the mix pass's launch: fp8:222:2:--attn-mix=128:8:3])
#   PROFILE_ARGS="--context 32768 --warmup 6 --steps 3"  NCU_S=90  E2E_S=480 (each)  E2E_ARGS="..."
#   E2E_GRIDS="default 8@64Kx32" (bench.e2e once per miss-copy grid, kernels/swap/copy_grid.py's
#   spec grammar: e2e-grid-<spec>.json; unset: one run, the engine's default grid)
#   COPYSWEEP="fp8:222:trace bf16:174:trace fp8:222:indexer" (row format:N:top-k source[:grids,
#   bench/profile/copy_sweep.py's --grids]) COPYSWEEP_S=135 (each) COPYSWEEP_ARGS="--context 32768"
#   (copysweep first prints the copy kernel's registers: bench/kernels/copy_regs.py, COPYREGS_S=45)
#   MTP_S=560  MTP_ARGS="--contexts 32768 --steady-steps 64 --budget-s 520" (D = 1,2,3 at the
#   BENCHMARK-ONLY synthetic acceptance 0.9,0.75,0.6; 128K: MTP_ARGS="--contexts 131072 ...")
#   PREFIX_S=120  PREFIX_ARGS="..."  GW_S=120  GW_ARGS="..."
#   DISAGG_S=540  DISAGG_ARGS="--topologies 1x1 --sources auto" (bench.disagg: prefill
#   and decode engines over NIXL against role both; needs .whl-nixl, bench/device_wheels.sh nixl;
#   2 + 2: DISAGG_ARGS="--topologies 2x2 --no-colocated"; with MTP on every engine: add
#   "--draft-tokens 1"; prefill on a GPU of its own (nvidia-h100-x2): "--prefill-gpus 1")
#   NCUATTN_S=120 NCUATTN_ARGS="--batch 111 --formats fp8,bf16 [--score-prefetch]" (Nsight Compute on
#   attention alone, with each stall reason's warps per issued instruction)
#   WIRE_CASES="--source pinned --target vram --pieces 1,512;--error-handling none" (bench.disagg.wire
#   once per ';'-separated case, NIXL alone between two processes; WIRE_S=60 each; needs .whl-nixl)
set -uo pipefail
OUT=${OUT:-.gpuout}
RUN="$OUT/run"
mkdir -p "$RUN"
# .whl (bench/device_wheels.sh), .whl-nixl (device_wheels.sh nixl, slimmed to fit beside .whl:
# carry [".whl", ".whl-nixl"]), .whl-flashmla (device_wheels.sh flashmla: the attention case's
# FlashMLA anchor) and .whl-sglang (device_wheels.sh sglang: the sglang_swap case's anchor),
# whichever are there.
shopt -s nullglob
wheels=(.whl/*.whl .whl-nixl/*.whl .whl-flashmla/*.whl .whl-sglang/*.whl)
shopt -u nullglob
if [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${wheels[@]}"
  export PYTHONPATH=/tmp/site:$PWD
  # A wheel's executables (ninja, which SGLang's JIT build runs) land in the target's bin/.
  export PATH=/tmp/site/bin:$PATH
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L
git log --oneline -1 2>/dev/null || cat .commit 2>/dev/null
summary=()
stage() {  # name, limit seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$RUN/$name.log" 2>&1
  local rc=$?
  tail -30 "$RUN/$name.log"
  summary+=("$(printf '%-12s rc=%-4s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -Eo '[0-9]+ (passed|failed|skipped|error)[^=]*' "$RUN/$name.log" | tail -1)")")
}
profiles() {
  for spec in ${PROFILES:-bf16:128:1 bf16:128:2}; do
    IFS=: read -r fmt bs mb extra <<< "$spec"
    local name="profile-$fmt-$bs-mb$mb$(echo "${extra:-}" | tr -c 'A-Za-z0-9\n' '-')"
    stage "$name" "${PROF_S:-60}" python3 -m bench.profile --preset bench \
      --mode embedded --row-format "$fmt" --batch "$bs" --microbatches "$mb" ${extra//,/ } \
      ${PROFILE_ARGS:---context 32768 --warmup 6 --steps 3} --out "$RUN/$name.json"
  done
  copy_costs | tee "$RUN/copy-costs.txt"
  family_deltas | tee "$RUN/family-deltas.txt"
}
family_deltas() {  # each profile with flags against the plain profile of its format, batch and
  # parts (bench/profile/family_delta.py): which kernel families an option moved
  local j base plain
  for j in "$RUN"/profile-*-mb*-*.json; do
    [ -f "$j" ] || continue
    base=$(basename "$j" .json)
    case "$base" in *skip-copy*) continue ;; esac
    plain="$RUN/$(plain_name "$base").json"
    [ -f "$plain" ] && echo "=== $(basename "$plain" .json) -> $base" \
      && python3 -m bench.profile.family_delta "$plain" "$j"
  done
}
plain_name() {  # a profile's plain twin: its format, batch and parts, without flags
  echo "$1" | grep -Eo '^profile-[a-z0-9]+-[0-9]+-mb[0-9]+'
}
copy_costs() {  # each profile's copy cost (bench/profile/copy_cost.py) against its own --skip-copy
  # twin (the same flags and --skip-copy), else the plain --skip-copy profile of its format, batch
  # and parts
  local j base twin plain
  for j in "$RUN"/profile-*.json; do
    base=$(basename "$j" .json)
    case "$base" in *skip-copy*) continue ;; esac
    plain="$RUN/$(plain_name "$base")--skip-copy.json"
    twin="$RUN/$base---skip-copy.json"
    [ -f "$twin" ] || twin=$plain
    [ -f "$twin" ] && echo "$base vs $(basename "$twin" .json): $(python3 -m \
      bench.profile.copy_cost "$j" "$twin")"
  done
}
ncus() {  # Nsight Compute on the miss copy alone (bench/kernels/ncu_copy.py): both row formats, the
  # side stream's grid, 64 CTAs all working, the default grid; the second round of its launches
  stage ncu "${NCU_S:-90}" ncu --clock-control none -k regex:miss_copy --launch-skip 6 \
    --launch-count 6 --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \
    --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    python3 -m bench.kernels.ncu_copy
}
ncuattn() {  # Nsight Compute on the engine's attention alone (bench/kernels/ncu_attention.py): score
  # and mix passes, fp8 then bf16, at bs 111; the second round of its launches
  stage ncuattn "${NCUATTN_S:-120}" ncu --clock-control none -k 'regex:_score_kernel|_mix_kernel' \
    --launch-skip 4 --launch-count 4 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
    python3 -m bench.kernels.ncu_attention ${NCUATTN_ARGS:-}
}
e2es() {  # bench.e2e once, or once per miss-copy grid of E2E_GRIDS (a same-call pair: run U5's
  # default-grid twin was a second invocation, cut by its own limit before it wrote anything)
  if [ -z "${E2E_GRIDS:-}" ]; then
    stage e2e "${E2E_S:-480}" python3 -m bench.e2e ${E2E_ARGS:-} --out "$RUN/e2e.json"
    return
  fi
  local grid name
  for grid in $E2E_GRIDS; do
    name="e2e-grid-$(echo "$grid" | tr -c 'A-Za-z0-9\n' '-')"
    stage "$name" "${E2E_S:-480}" python3 -m bench.e2e ${E2E_ARGS:-} --copy-grid "$grid" \
      --out "$RUN/$name.json"
  done
}
copysweep() {  # the step against the side-stream copy's grid (bench/profile/copy_sweep.py)
  stage copyregs "${COPYREGS_S:-45}" python3 -m bench.kernels.copy_regs
  local limit=${COPYSWEEP_S:-135}
  for spec in ${COPYSWEEP:-fp8:222:trace bf16:174:trace fp8:222:indexer}; do
    IFS=: read -r fmt bs src grids <<< "$spec"
    if [ -z "$grids" ] && [ "$src" = indexer ]; then
      grids="none,24,64,132,default,64/16/512K,132/16/512K,132/16/1M,132/16/2M"
    fi
    local name="copysweep-$fmt-$bs-$src"
    stage "$name" "$limit" python3 -m bench.profile.copy_sweep --preset bench --row-format "$fmt" \
      --batch "$bs" --topk-source "$src" ${grids:+--grids "$grids"} \
      --budget-s $((limit - 15)) ${COPYSWEEP_ARGS:---context 32768} --out "$RUN/$name.json"
  done
}
wires() {  # bench.disagg.wire once per case of WIRE_CASES (';'-separated argument lists)
  local i=0 case cases
  IFS=';' read -ra cases <<< "${WIRE_CASES:---source pinned --target vram --pieces 1,512}"
  for case in "${cases[@]}"; do
    i=$((i + 1))
    stage "wire-$i" "${WIRE_S:-60}" python3 -m bench.disagg.wire $case --out "$RUN/wire-$i.json"
  done
}
STAGES="${*:-tests sanitize kernels}"
for s in $STAGES; do
  case $s in
    host) stage host "${HOST_S:-45}" python3 -m bench.kernels.copy_span --allocs cuda \
            --row-bytes 656 --spans 2048 --runs 1 --out "$RUN/host.json" ;;
    hostgather) stage hostgather "${HG_S:-90}" python3 -m bench.kernels.host_gather ${HG_ARGS:-} \
                  --out "$RUN/hostgather.json" ;;
    hostnode) stage hostnode "${HN_S:-60}" python3 -m bench.kernels.host_node ${HN_ARGS:-} \
                --out "$RUN/hostnode.json" ;;
    tests) stage tests "${TEST_S:-300}" python3 -m pytest -q -m "${TEST_M:-gpu}" -p no:cacheprovider \
             -n "${TEST_N:-4}" --durations=15 --timeout "${TEST_TIMEOUT:-150}" \
             ${TEST_K:+-k "$TEST_K"} ${TESTS:-tests} ;;
    sanitize) stage sanitize "${SAN_S:-570}" env OUT="$RUN" bash bench/sanitize.sh ;;
    kernels) stage kernels "${KERN_S:-100}" python3 -m bench.kernels ${KERNEL_QUICK---quick} \
               --cases "${KERNEL_CASES-miss_copy,attention}" --out "$RUN/kernels.json" ;;
    sweep) stage sweep "${SWEEP_S:-150}" python3 -m bench.kernels.attention_sweep ${SWEEP_ARGS:-} \
             --out "$RUN/sweep.json" ;;
    profiles) profiles ;;
    ncu) ncus ;;
    ncuattn) ncuattn ;;
    copysweep) copysweep ;;
    e2e) e2es ;;
    wire) wires ;;
    gateway) stage gateway "${GW_S:-120}" python3 -m bench.gateway ${GW_ARGS:-} \
               --out "$RUN/gateway.json" ;;
    mtp) stage mtp "${MTP_S:-560}" python3 -m bench.mtp \
           ${MTP_ARGS:---contexts 32768 --steady-steps 64 --budget-s 520} --out "$RUN/mtp.json" ;;
    prefix) stage prefix "${PREFIX_S:-120}" python3 -m bench.prefix ${PREFIX_ARGS:-} \
              --out "$RUN/prefix.json" ;;
    disagg) stage disagg "${DISAGG_S:-540}" python3 -m bench.disagg \
              ${DISAGG_ARGS:---topologies 1x1 --sources auto} --out "$RUN/disagg.json" ;;
    *) echo "unknown stage $s" ;;
  esac
done
# A second invocation in the same device call packs beside the first (run-2.tgz, summary-2.txt)
# instead of over it: run S lost an e2e JSON to the tests stage that followed it.
n=1; sfx=""
while [ -e "$OUT/run$sfx.tgz" ]; do n=$((n + 1)); sfx="-$n"; done
printf '%s\n' "${summary[@]}" > "$OUT/summary$sfx.txt"
tar czf "$OUT/run$sfx.tgz" -C "$OUT" run && rm -rf "$RUN"
echo; echo "=== summary"; cat "$OUT/summary$sfx.txt"
