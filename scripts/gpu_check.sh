#!/usr/bin/env bash
# Every check and measurement of docs/gpu.md in one command, part by part:
#
#   bash scripts/gpu_check.sh OUT_DIR [PART ...]   (PART: env, tests, demo, demo-mps, shapes, matched,
#                                                   contention, dsweep; default: all, in that order)
#   bash scripts/gpu_check.sh --list               (print each part's commands, run nothing)
#
# A part's output goes to OUT_DIR/<part>.log and its figures (JSON, PNG) under OUT_DIR/<part>/.
# A part that fails is reported and the next one still runs; the exit status is 1 if any failed.
# Each command runs under `timeout` when COMMAND_TIMEOUT (seconds) is set, so that one slow command
# cannot take all of a borrowed machine's time. PYTHON picks the interpreter (default python3).
# Needs the project's Python dependencies (not Ray) and, for every part but `dsweep`, a CUDA device.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
parts=(env tests demo demo-mps shapes matched contention dsweep)

# The commands of a part, one per line, with {out} standing for the part's folder.
commands() {
    case "$1" in
    env)
        echo "nvidia-smi"
        echo "$PYTHON -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())'"
        echo "nproc"
        ;;
    tests)
        echo "$PYTHON -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_step_graphs.py"
        ;;
    demo)
        # The demo pair at batch 1, SSD's draft worker on the target's GPU (no MPS).
        echo "$PYTHON -m ssd.bench --device cuda --settings machine --modes ar,sd,ssd,hf-assisted --batch-sizes 1 --temperatures 0,1 --no-progress --out-dir {out}"
        ;;
    demo-mps)
        # The same with an MPS daemon, which lets the worker's kernels run beside the target's.
        # The daemon is stopped whether or not the bench succeeds.
        echo "nvidia-cuda-mps-control -d && { $PYTHON -m ssd.bench --device cuda --settings machine --modes sd,ssd --batch-sizes 1 --temperatures 0,1 --no-progress --out-dir {out}; s=\$?; echo quit | nvidia-cuda-mps-control; exit \$s; }"
        ;;
    shapes)
        # Random-weight Llama-3.1-8B / Llama-3.2-1B shapes in bfloat16: speed against the bandwidth bound.
        echo "$PYTHON -m ssd.bench.real_shapes --modes ar,sd,ssd --out {out}/real_shapes.json"
        ;;
    matched)
        # The acceptance-matched pair at the same shapes (ssd/bench/matched_pair.py), batch 1: ar, sd,
        # ssd (its worker on the same GPU, under MPS) and auto at T=0 and T=1, acceptance by position,
        # and the projection for a draft on its own GPU (ssd/bench/projection.py) with its inputs.
        echo "nvidia-cuda-mps-control -d && { $PYTHON -m ssd.bench.matched_bench --modes ar,sd,ssd,auto --temperatures 0,1 --num-prompts 4 --tokens 128 --out {out}/matched_pair.json; s=\$?; echo quit | nvidia-cuda-mps-control; exit \$s; }"
        ;;
    contention)
        # What SSD's draft worker on the same GPU costs the target: its verification with the worker
        # idle, drafting a tree, or spinning, in alternating blocks.
        echo "$PYTHON -m benchmarks.contention --device cuda --cycles 30 --out {out}/contention.json"
        ;;
    dsweep)
        # The draft pool on the machine's cores: D = 1, 2, 4, 8 workers, a core each, both ways of
        # sharing the work, at batch 1 (placed by the OS and pinned) and 16 (the paper's projection
        # is at 16); then the miss law.
        echo "$PYTHON -m ssd.bench --device cpu --settings paper --modes sd,ssd --draft-workers 1,2,4,8 --draft-splits outcomes,sequences --draft-worker-cpus shared,pinned --temperatures 0,1 --batch-sizes 1 --num-prompts 4 --max-tokens 64 --pair-reps 10 --no-progress --out-dir {out}"
        echo "$PYTHON -m ssd.bench --device cpu --settings paper --modes sd,ssd --draft-workers 1,2,4,8 --draft-splits outcomes,sequences --temperatures 0,1 --batch-sizes 16 --num-prompts 16 --max-tokens 32 --pair-reps 2 --no-progress --out-dir {out}/batch16"
        echo "$PYTHON -m benchmarks.miss_law --workers 1,2,4,8 --temperatures 0,1 --num-prompts 4 --max-tokens 64 --out {out}/miss_law.json"
        ;;
    *)
        echo "unknown part '$1'; the parts are: ${parts[*]}" >&2
        return 2
        ;;
    esac
}

# Runs one part's commands in order, stopping at the first that fails; returns its status.
run_part() {
    local part=$1 out=$2 line status=0 dir
    mkdir -p "$out/$part"
    dir=$(printf '%q' "$out/$part") # quoted: the commands are run by `bash -c`
    while IFS= read -r line; do
        line=${line//\{out\}/$dir}
        echo "+ $line"
        if [[ -n ${COMMAND_TIMEOUT:-} ]]; then
            timeout --kill-after=10 "$COMMAND_TIMEOUT" bash -c "$line" || status=$?
        else
            bash -c "$line" || status=$?
        fi
        [[ $status -eq 0 ]] || break
    done < <(commands "$part")
    return "$status"
}

main() {
    if [[ ${1:-} == --list ]]; then
        for part in "${parts[@]}"; do
            echo "[$part]"
            commands "$part"
        done
        return 0
    fi
    if [[ $# -lt 1 || ${1:-} == -* ]]; then
        sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
        return 2
    fi
    local out=$1 failed=0 part started status
    shift
    local chosen=("$@")
    [[ ${#chosen[@]} -gt 0 ]] || chosen=("${parts[@]}")
    for part in "${chosen[@]}"; do
        commands "$part" >/dev/null || return 2
    done
    mkdir -p "$out"
    export PYTHONUNBUFFERED=1
    local summary=()
    for part in "${chosen[@]}"; do
        started=$SECONDS
        run_part "$part" "$out" >"$out/$part.log" 2>&1
        status=$?
        summary+=("$part: exit $status, $((SECONDS - started)) s")
        [[ $status -eq 0 ]] || failed=1
        echo "${summary[-1]}"
        tail -n 25 "$out/$part.log"
    done
    printf '%s\n' "${summary[@]}"
    return "$failed"
}

main "$@"
