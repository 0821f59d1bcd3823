#!/bin/sh
# Load client of the compose stack: LOADGEN_STREAMS concurrent `python -m engine_client generate`
# streams against $ENGINE_TARGET, each one's summary, then the aggregate decode throughput.
# Exits non-zero if any stream failed. Installed in the image as /usr/local/bin/hisparse-loadgen.
set -u

streams=${LOADGEN_STREAMS:-4}
prompt_len=${LOADGEN_PROMPT_LEN:-24}
new_tokens=${LOADGEN_MAX_NEW_TOKENS:-24}
# Token ids stay below 251 so the prompt fits every preset's vocabulary (tiny has 256).
prompt=$(seq 1 "$prompt_len" | awk '{ printf "%s%d", (NR > 1 ? "," : ""), $1 % 250 + 1 }')
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

echo "loadgen: $streams streams x $new_tokens new tokens, prompt $prompt_len tokens," \
     "engine ${ENGINE_TARGET:-default}"
pids=""
i=0
while [ "$i" -lt "$streams" ]; do
    i=$((i + 1))
    # Distinct seeds: with LOADGEN_TEMPERATURE > 0 the streams sample different tokens.
    # The end time is taken as each client exits, to place its stream on one time line.
    {
        python -m engine_client generate --ids "$prompt" --max-new-tokens "$new_tokens" \
            --temperature "${LOADGEN_TEMPERATURE:-0}" --seed "$i"
        echo "exit $? end $(date +%s.%N)"
    } >"$logs/$i.out" 2>&1 &
    pids="$pids $!"
done
for pid in $pids; do
    wait "$pid"
done

# A failed stream's reason is the client's `generate: ...` line: shown, not only counted.
grep -h -E '^(request |error|generate: )' "$logs"/*.out
# Each client starts Python and torch first, so wall time would mostly measure that. A stream's
# own span is its end minus (TTFT + ITL mean * (tokens - 1)); throughput is all tokens over the
# union of the spans, from the first request sent to the last token received.
cat "$logs"/*.out | awk -v n="$streams" '
    /^request / {
        tokens = $3; ttft = 0; itl = 0
        for (i = 1; i < NF; i++) {
            if ($i == "TTFT") ttft = $(i + 1)
            if ($i == "mean") itl = $(i + 1)
        }
    }
    /^exit / {
        if ($2 != 0) { failed++; next }
        start = $4 - (ttft + itl * (tokens - 1)) / 1000
        if (first == "" || start < first) first = start
        if (last == "" || $4 > last) last = $4
        total += tokens
    }
    END {
        span = last - first
        printf "loadgen: %d streams, %d failed, %d tokens in %.2f s: %.1f tok/s\n", \
            n, failed, total, span, (span > 0 ? total / span : 0)
        exit (failed > 0 || total == 0)
    }'
