#!/bin/sh
# Restarts kv-service RESTART_ROUNDS times (5) while generations stream through the engine, and
# checks each time that the engine container kept its process (same host PID and start time, no
# container restart), re-attached to the new service by itself (health SERVING again, one more
# "re-attached" in its log), and serves a new generation to its end.
#
#   docker/restart-check.sh [-f FILE]...     (default: -f docker/docker-compose.cpu.yml)
#
# Needs a Docker daemon and the image (`docker-compose -f docker/docker-compose.cpu.yml build`).
# Runs as its own compose project (RESTART_PROJECT, default hisparse-restart-<pid>) and removes
# it, volumes included, at the end unless KEEP_STACK=1. The service drains for at most
# RESTART_DRAIN_TIMEOUT seconds (1), so the streams are still running when it goes; a stream cut
# by the restart may fail, the engine must not. Exit status 0 only if every round passed.
set -u

rounds=${RESTART_ROUNDS:-5}
project=${RESTART_PROJECT:-hisparse-restart-$$}
new_tokens=${RESTART_NEW_TOKENS:-400}
files=""
while [ $# -gt 0 ]; do
    case "$1" in
        -f) files="$files -f $2"; shift 2 ;;
        *) echo "usage: $0 [-f COMPOSE_FILE]..." >&2; exit 2 ;;
    esac
done
[ -n "$files" ] || files="-f $(dirname "$0")/docker-compose.cpu.yml"
export HISPARSE_DRAIN_TIMEOUT="${RESTART_DRAIN_TIMEOUT:-1}"
logs=$(mktemp -d)

# Every call into the stack is bounded: an exec whose container dies under it may never return.
dc() {
    seconds=$1
    shift
    # shellcheck disable=SC2086
    timeout "$seconds" docker-compose -p "$project" $files "$@"
}

cleanup() {
    [ "${KEEP_STACK:-0}" = 1 ] || dc 300 down -v --remove-orphans >/dev/null 2>&1
    rm -rf "$logs"
}
trap cleanup EXIT
trap "exit 130" INT TERM HUP

fail() {
    echo "restart-check: FAIL: $*" >&2
    dc 60 logs --tail 40 engine kv-service >&2
    exit 1
}

# Health of the engine as its own check sees it, once a second for up to $1 seconds.
wait_serving() {
    i=0
    until dc 30 exec -T engine hisparse-healthcheck --quiet unix:///run/hisparse/engine.sock \
            --service decode.v1.DecodeService >/dev/null 2>&1; do
        i=$((i + 1))
        [ "$i" -lt "$1" ] || return 1
        sleep 1
    done
}

generate() {
    dc 180 exec -T engine python -m engine_client generate --target /run/hisparse/engine.sock \
        --ids 1,2,3,4,5,6,7,8 --max-new-tokens "$1" --timeout 120
}

engine_state() {
    docker inspect -f '{{.State.Pid}} {{.State.StartedAt}} {{.RestartCount}}' "$engine"
}

dc 900 up -d engine || fail "the stack did not start"
wait_serving 300 || fail "the engine never reported SERVING"
engine=$(dc 60 ps -q engine)
before=$(engine_state)
echo "restart-check: engine container $engine, pid/start/restarts: $before"

n=1
while [ "$n" -le "$rounds" ]; do
    for s in 1 2; do
        generate "$new_tokens" >"$logs/$n.$s" 2>&1 &
        eval "stream_$s=\$!"
    done
    # In flight: both streams have their request id (printed before any token).
    i=0
    until [ "$(grep -l '^request ' "$logs/$n.1" "$logs/$n.2" 2>/dev/null | wc -l)" -eq 2 ]; do
        i=$((i + 1))
        [ "$i" -lt 120 ] || fail "round $n: the streams never started"
        sleep 0.5
    done
    dc 300 restart kv-service >/dev/null 2>&1 || fail "round $n: docker-compose restart kv-service"
    # shellcheck disable=SC2154
    wait "$stream_1"; rc1=$?
    # shellcheck disable=SC2154
    wait "$stream_2"; rc2=$?
    wait_serving 180 || fail "round $n: the engine did not serve again after the restart"
    now=$(engine_state) || fail "round $n: the engine container is gone"
    [ "$now" = "$before" ] || fail "round $n: engine pid/start/restarts $before -> $now"
    attached=$(dc 60 logs engine 2>/dev/null | grep -c "re-attached to")
    [ "$attached" -ge "$n" ] || fail "round $n: $attached re-attaches in the engine log"
    generate 16 >"$logs/$n.new" 2>&1 || fail "round $n: new request: $(tail -3 "$logs/$n.new")"
    grep -q "LENGTH" "$logs/$n.new" || fail "round $n: new request did not finish: $(cat "$logs/$n.new")"
    echo "restart-check: round $n: engine kept (pid ${before%% *}), streams in flight exited" \
         "$rc1/$rc2, re-attached ($attached so far), new request served"
    n=$((n + 1))
done
echo "restart-check: $rounds kv-service restarts, engine kept its process and re-attached each time"
