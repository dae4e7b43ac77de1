#!/usr/bin/env bash
# Unsloth's own Python environment for benchmarks/unsloth_e2e.py (it cannot share nbkit's: Unsloth 2026.10.9 pins
# trl<=1.15 and datasets<5, nbkit's benchmark wheels are trl 1.16 and datasets 5.2).
#
#   bash benchmarks/unsloth_env.sh build   # here, with PyPI: fill the git-ignored .unsloth/ (11.2 MB; 5.9 MB with
#                                          # UNSLOTH_KEEP_STUDIO=0)
#   . benchmarks/unsloth_env.sh            # on the GPU machine, from the repo root: build /tmp/usite and export
#                                          # PYTHONPATH=<repo>:/tmp/usite and the offline switches
#   bash benchmarks/unsloth_env.sh         # the same, but prints the export lines instead (eval "$(...)")
#
# .unsloth/ holds: the unsloth_zoo, trl 1.15.0 and datasets 4.8.5 wheels, and unsloth's wheel unpacked and stripped
# to a .tar.xz (its studio/ web app's frontend and assets dropped: 82 of its 110 MB unpacked; every .py file kept,
# studio's included). /tmp/usite gets those plus bitsandbytes, dill and multiprocess from .whl/ (not .whl/'s trl 1.16
# or datasets 5.2). Everything else Unsloth imports is on the machine already (torch, triton, transformers, peft,
# accelerate, huggingface_hub, torchvision, sentencepiece, protobuf, pillow, regex, requests, psutil, pyarrow,
# pandas, xxhash, fsspec, httpx). Left out because Unsloth imports them only inside try/except or on other paths:
# xformers, flash-attn, torchao, cut_cross_entropy (off on torch >= 2.8 anyway: UNSLOTH_ENABLE_CCE=0), vllm,
# hf_transfer, msgspec (vllm only), tyro, pydantic, diffusers.

_UNSLOTH_VERSION=2026.10.9

_unsloth_build() {
    local tmp root=$PWD
    tmp=$(mktemp -d) || return 1
    mkdir -p .unsloth || return 1
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$tmp" "unsloth==$_UNSLOTH_VERSION" "unsloth_zoo==$_UNSLOTH_VERSION" trl==1.15.0 \
        datasets==4.8.5 || return 1
    rm -f .unsloth/*.whl .unsloth/*.tar.xz
    cp "$tmp"/unsloth_zoo-*.whl "$tmp"/trl-*.whl "$tmp"/datasets-*.whl .unsloth/ || return 1
    mkdir "$tmp/x" && (cd "$tmp/x" && python3 -m zipfile -e "$tmp/unsloth-$_UNSLOTH_VERSION-py3-none-any.whl" .) || return 1
    # studio/'s .py files (5.3 MB of the .tar.xz; Unsloth's training code reads none of them, only its
    # decision-model export does): UNSLOTH_KEEP_STUDIO=0 leaves them out
    (cd "$tmp/x" && if [ "${UNSLOTH_KEEP_STUDIO:-1}" = 0 ]; then : >"$tmp/studio.txt"; else
        find studio -name '*.py' | LC_ALL=C sort >"$tmp/studio.txt"; fi &&
        tar -cJf "$root/.unsloth/unsloth-$_UNSLOTH_VERSION-stripped.tar.xz" unsloth unsloth_cli \
            "unsloth-$_UNSLOTH_VERSION.dist-info" -T "$tmp/studio.txt") || return 1
    rm -rf "$tmp"
    grep -qx '/.unsloth/' .git/info/exclude 2>/dev/null || echo '/.unsloth/' >>.git/info/exclude
    du -ab .unsloth | sort -n >&2
}

_unsloth_setup() {
    local site=${USITE:-/tmp/usite}
    if ! ls .unsloth/unsloth-*-stripped.tar.xz >/dev/null 2>&1 || ! ls .whl/bitsandbytes-*.whl >/dev/null 2>&1; then
        echo "unsloth_env.sh: run from the repo root, with .unsloth/ and .whl/ carried" >&2
        return 1
    fi
    rm -rf "$site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        .whl/bitsandbytes-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl .unsloth/*.whl >&2 || return 1
    tar -xJf .unsloth/unsloth-*-stripped.tar.xz -C "$site" || return 1
    # the repo first (benchmarks/, nbkit/), then Unsloth's site; not /tmp/site (trl 1.16, datasets 5.2)
    _UNSLOTH_ENV="PYTHONPATH=$PWD:$site
HF_HUB_OFFLINE=1
TRANSFORMERS_OFFLINE=1
HF_DATASETS_OFFLINE=1
HF_HUB_DISABLE_TELEMETRY=1
UNSLOTH_DISABLE_STATISTICS=1
UNSLOTH_COMPILE_LOCATION=/tmp/unsloth_compiled_cache
TOKENIZERS_PARALLELISM=false
PYTHONUNBUFFERED=1
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}"
}

# Offline: HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE / HF_DATASETS_OFFLINE make Unsloth skip its statistics download
# (models/_utils.get_statistics), its has_internet() probe and its mapper refresh from GitHub, and keep
# huggingface_hub off the network; UNSLOTH_DISABLE_STATISTICS is its own opt-out of the statistics download.
# UNSLOTH_COMPILE_LOCATION: the trainer code Unsloth generates goes to /tmp, not into the repo's working tree.
# torch.compile is left at Unsloth's default: per decoder layer (models/_block_compile.py), not whole-model graphs,
# and part of the speed a user gets; the benchmark's warmup steps absorb its compile time. UNSLOTH_BLOCK_COMPILE=0
# (set before running) turns it off. CUDA_VISIBLE_DEVICES (0 unless set; the machine has one GPU): with
# NVIDIA_VISIBLE_DEVICES naming a GPU and CUDA_VISIBLE_DEVICES unset (a container's --gpus), Unsloth cuts Inductor to
# one compile thread (_gpu_init.py), which would make that first compile several times slower.
if (return 0 2>/dev/null); then
    if [ "${1:-}" = build ]; then
        _unsloth_build
    elif _unsloth_setup; then
        while IFS= read -r _line; do export "${_line?}"; done <<<"$_UNSLOTH_ENV"
        echo "unsloth_env.sh: PYTHONPATH=$PYTHONPATH" >&2
        unset _line
    else
        false
    fi
else
    set -u
    if [ "${1:-}" = build ]; then
        _unsloth_build
    else
        _unsloth_setup || exit 1
        while IFS= read -r _line; do printf 'export %q\n' "$_line"; done <<<"$_UNSLOTH_ENV"
    fi
fi
