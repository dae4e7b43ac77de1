#!/usr/bin/env bash
# Unsloth's notebook recipe (benchmarks/unsloth_recipe.py) on one GPU, three trainers side by side: plain TRL
# SFTTrainer (sft) and nbkit's FastSFT (fastsft) run by benchmarks/e2e.py, Unsloth by benchmarks/unsloth_e2e.py in
# its own environment (benchmarks/unsloth_env.sh). The random model is saved once; then, mode by mode, each trainer
# trains in a Python process of its own (a fresh allocator, and empty compile caches, as in a fresh notebook), its
# whole train() and every step timed. Last it prints benchmarks/recipe_table.py's table: mode, trainer, train() s,
# speed vs Unsloth over the whole run, median step ms, the first 4 steps, peak GiB, first / last loss.
#
# On the GPU machine, from the repo root, with .whl/ and .unsloth/ carried and $OUT set (no internet needed):
#
#   SHAPE=1.7b MODES=bf16,fp16@15,bf16@22 STEPS=60 PATHS=sft,fastsft,unsloth LIMIT=600 \
#       bash benchmarks/recipe_round.sh
#
#   SHAPE        1.7b (default) or 14b
#   MODES        comma list of <compute>[@<cap GiB>]: bf16 or fp16, the process's GPU memory capped at that many GiB
#                (e2e.cap_memory; a T4: fp16@15, an L4: bf16@22); default bf16,fp16@15,bf16@22
#   STEPS        optimizer steps per run, warm-up included (default 60, the recipe's)
#   PATHS        the trainers, run in this order in each mode: sft, fastsft, unsloth (default all three); a
#                fastsft[switch=value;...] path is FastSFT with those switches (benchmarks/e2e.py's path syntax)
#   LIMIT        seconds each process may run (timeout; default 900): one that runs over leaves no row
#   TOKENS       max_length, the rows' cut (default 2048, the recipe's)
#   MODEL_DIR    the random model's folder (default /tmp/nbkit-recipe-<shape>), reused when it holds one
#   WARM_CACHES  1: the processes share torch.compile's, Triton's and Unsloth's compile caches (default: empty ones
#                for each process)
#   NBKIT_GIT_COMMIT  the full hash of the commit the copy was made from (a copy without .git records "unknown"); a
#                short one is refused before anything runs: the results files record it
#   MEMORY_LOG   1: the sft and fastsft processes run with e2e's --memory-log (nbkit's decisions and the figures
#                they came from, each capture's reserved memory, GPU memory after every optimizer step) in their logs
#   FIRST_STEPS  1: after each sft or fastsft process, one more of the same path (5 steps, empty compile caches)
#                with e2e's --first-steps-profile: where train()'s start and each of the first 4 steps go on the
#                host (pyinstrument, in .whl/). Its results and log go to profiles/, apart from the timed rows
#   NBKIT_SOURCE a folder whose nbkit/ is imported instead of the repo's (another commit's, unpacked with
#                `git archive <commit> nbkit | tar -x -C <folder>`), to time it beside this one on the same machine
#                (python -P: the working folder, the repo, is not put before PYTHONPATH)
#
# $OUT gets two files (the machine sends back 8 at most): recipe_round_<shape>.tar.gz, the results file of every
# process (one per script run, written by write_results) and its log (json/, logs/; profiles/ with FIRST_STEPS=1),
# rewritten after each process so a round cut short keeps what finished; and recipe_round_<shape>.log, this
# script's status lines and table. Here:
#   mkdir r && tar -xzf recipe_round_1.7b.tar.gz -C r && python -m benchmarks.recipe_table r/json
set -u

SHAPE=${SHAPE:-1.7b}
MODES=${MODES:-bf16,fp16@15,bf16@22}
STEPS=${STEPS:-60}
PATHS=${PATHS:-sft,fastsft,unsloth}
LIMIT=${LIMIT:-900}
TOKENS=${TOKENS:-2048}
MODEL_DIR=${MODEL_DIR:-/tmp/nbkit-recipe-$SHAPE}
WARM_CACHES=${WARM_CACHES:-0}
MEMORY_LOG=${MEMORY_LOG:-0}
FIRST_STEPS=${FIRST_STEPS:-0}
: "${OUT:?set OUT: the folder the results go to}"
if [ -n "${NBKIT_GIT_COMMIT:-}" ] && ! [[ $NBKIT_GIT_COMMIT =~ ^[0-9a-f]{40}$ ]]; then
    echo "NBKIT_GIT_COMMIT=$NBKIT_GIT_COMMIT: give the full 40-digit hash (git rev-parse HEAD);" \
        "the results files need it" >&2
    exit 2
fi

ROOT=$PWD
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nbkit-recipe-round-XXXXXX") || exit 1
mkdir -p "$OUT" "$WORK/json" "$WORK/logs" "$WORK/profiles" || exit 1
SUMMARY=$OUT/recipe_round_$SHAPE.log
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1

e2e() {  # e2e.py in a process of its own: e2e <results folder> <compile caches> <log> <e2e arguments...>
    local out=$1 caches=$2 log=$3
    shift 3
    env OUT="$out" PYTHONPATH="$NBKIT_PATH" TORCHINDUCTOR_CACHE_DIR="$caches/inductor" \
        TRITON_CACHE_DIR="$caches/triton" timeout -k 30 "$LIMIT" python3 -P -m benchmarks.e2e "$@" >"$log" 2>&1
}

say() { printf '[recipe_round %s] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$SUMMARY"; }

bundle() {  # the results and logs so far, as one file in $OUT (replaced whole)
    tar -czf "$OUT/.recipe_round_$SHAPE.tar.gz" -C "$WORK" json logs profiles &&
        mv -f "$OUT/.recipe_round_$SHAPE.tar.gz" "$OUT/recipe_round_$SHAPE.tar.gz"
}

case ",$PATHS," in *,unsloth,*) want_unsloth=1 ;; *) want_unsloth=0 ;; esac
say "shape $SHAPE, modes $MODES, $STEPS steps, paths $PATHS, ${LIMIT} s a process, rows cut at $TOKENS"
say "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -n 1)"

# nbkit's environment: the repo (nbkit, benchmarks) first, then .whl/'s trl 1.16, datasets 5.2, bitsandbytes, ...
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    { say "could not install .whl/ into /tmp/site"; exit 1; }
NBKIT_PATH=${NBKIT_SOURCE:+$NBKIT_SOURCE:}$ROOT:/tmp/site
# Unsloth's: built once (/tmp/usite); its export lines are sourced by each of its processes only
if [ "$want_unsloth" = 1 ]; then
    bash benchmarks/unsloth_env.sh >"$WORK/unsloth.env" || { say "could not set up Unsloth's environment"; exit 1; }
fi

t0=$SECONDS
if [ -f "$MODEL_DIR/config.json" ]; then
    say "model $SHAPE: reused from $MODEL_DIR"
else
    say "model $SHAPE: saving to $MODEL_DIR"
    rm -rf "$MODEL_DIR"
    PYTHONPATH=$NBKIT_PATH timeout -k 30 "$LIMIT" python3 -c '
import sys
from benchmarks.e2e import save_random_model
from benchmarks.unsloth_e2e import add_tokenizer
print(f"saved in {save_random_model(sys.argv[1], None, sys.argv[2], tiny=False):.1f} s", flush=True)
add_tokenizer(sys.argv[2])' "$SHAPE" "$MODEL_DIR" || { say "could not save the model"; rm -rf "$MODEL_DIR"; exit 1; }
fi
say "model ready in $((SECONDS - t0)) s"

missing=()
IFS=, read -r -a modes <<<"$MODES"
IFS=, read -r -a paths <<<"$PATHS"
for mode in "${modes[@]}"; do
    compute=${mode%%@*}
    cap=""
    [ "$mode" != "$compute" ] && cap=${mode#*@}
    case $compute in
        bf16) precision=() ;;
        fp16) precision=(--fp16) ;;
        *) say "mode $mode: the compute dtype must be bf16 or fp16"; missing+=("$mode (bad mode)"); continue ;;
    esac
    tokens=$TOKENS${cap:+@$cap}
    for path in "${paths[@]}"; do
        key=${SHAPE}_${compute}${cap:+_cap$cap}_$(printf '%s' "$path" | tr -c 'A-Za-z0-9_.=-' '_')
        log=$WORK/logs/$key.log
        caches=$WORK/cache/$key
        [ "$WARM_CACHES" = 1 ] && caches=$WORK/cache/shared
        mkdir -p "$caches"
        common=(--shape "$SHAPE" --recipe unsloth ${precision[@]+"${precision[@]}"} --tokens "$tokens"
                --steps "$STEPS" --model-dir "$MODEL_DIR")
        logged=()
        [ "$MEMORY_LOG" = 1 ] && logged=(--memory-log)
        t1=$SECONDS
        case $path in
            sft | fastsft | fastsft\[*\])
                e2e "$WORK/json" "$caches" "$log" "${common[@]}" ${logged[@]+"${logged[@]}"} --paths "$path"
                rc=$?
                if [ "$FIRST_STEPS" = 1 ]; then  # cold again: its own empty caches
                    rm -rf "$caches.first" && mkdir -p "$caches.first"
                    e2e "$WORK/profiles" "$caches.first" "$WORK/profiles/$key.log" "${common[@]}" --steps 5 \
                        --first-steps-profile --paths "$path" ||
                        say "$mode $path: the first-steps profile stopped with exit code $?"
                    rm -rf "$caches.first"
                fi
                ;;
            unsloth)
                (
                    # shellcheck disable=SC1091
                    . "$WORK/unsloth.env"
                    export OUT="$WORK/json" TORCHINDUCTOR_CACHE_DIR="$caches/inductor" \
                        TRITON_CACHE_DIR="$caches/triton" UNSLOTH_COMPILE_LOCATION="$caches/unsloth"
                    exec timeout -k 30 "$LIMIT" python3 -m benchmarks.unsloth_e2e "${common[@]}"
                ) >"$log" 2>&1
                rc=$?
                ;;
            *) say "path $path: one of sft, fastsft, unsloth"; missing+=("$mode $path (bad path)"); continue ;;
        esac
        [ "$WARM_CACHES" = 1 ] || rm -rf "$caches"
        case $rc in
            0) say "$mode $path: done in $((SECONDS - t1)) s" ;;
            124 | 137) say "$mode $path: stopped at the ${LIMIT} s limit"; missing+=("$mode $path (over ${LIMIT} s)") ;;
            *) say "$mode $path: exit code $rc after $((SECONDS - t1)) s; its log ends:"; tail -n 15 "$log"
               missing+=("$mode $path (exit code $rc)") ;;
        esac
        grep -h "^{'path'" "$log" | cut -c1-400 | tee -a "$SUMMARY"
        bundle
    done
done

say "round done in $((SECONDS - t0)) s"
for m in ${missing[@]+"${missing[@]}"}; do say "no row: $m"; done
{
    echo
    echo "$SHAPE, Unsloth's notebook recipe ($STEPS steps, rows cut at $TOKENS tokens), each trainer in its own process"
    echo
    PYTHONPATH=$ROOT python3 -m benchmarks.recipe_table "$WORK/json"
} 2>&1 | tee -a "$SUMMARY"
