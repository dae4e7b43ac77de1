#!/usr/bin/env bash
# colab_setup.sh: install nbkit into the running Python of a Colab or Kaggle notebook (or any machine) without
# touching the runtime's torch.
#
# What it does, in order:
#   1. detects the platform: Colab, Kaggle or other;
#   2. records the versions of the key packages (to tell later whether a runtime restart is needed);
#   3. pins the torch already installed (and torchvision/torchaudio, when present) in a pip constraints file, so
#      no dependency can replace it: pip fails instead of swapping torch;
#   4. installs nbkit from PyPI (default), a git URL or a local path, with versions of its dependencies (transformers,
#      trl, peft, bitsandbytes, datasets, accelerate, ipywidgets) that nbkit's own metadata declares compatible;
#   5. with --flash only: installs flash-attn if a prebuilt wheel for this runtime can be downloaded (never builds it
#      from source) and it imports against the installed torch; otherwise says why it skipped it;
#   6. prints the GPU, its compute capability, bf16 or fp16, the key versions, and whether to restart the runtime.
#
# It downloads and runs no remote script. --dry-run prints every command that would change something and runs none
# of them (detection still runs). Run it from a notebook cell with:  !bash colab_setup.sh [options]

set -euo pipefail

usage() {
    cat <<'EOF'
Usage: bash colab_setup.sh [--from SOURCE] [--flash] [--dry-run] [--python PYTHON]

  --from SOURCE    where nbkit comes from: "pypi" (default), a pip requirement such as "nbkit==0.1.0",
                   a git URL (git+https://github.com/OWNER/nbkit.git[@REF]) or a local path to a checkout
  --flash          also install flash-attn, only if a prebuilt wheel fits this runtime (pip's index and
                   PIP_FIND_LINKS / PIP_EXTRA_INDEX_URL are searched; it is never built from source)
  --dry-run        print the commands that would install anything, run none of them
  --python PYTHON  the Python to install into (default: $PYTHON, else python3, else python)
  -h, --help       this text
EOF
}

SOURCE="pypi"
FLASH=0
DRY_RUN=0
PY="${PYTHON:-}"

while [[ $# -gt 0 ]]; do
    case "$1" in
        --from) [[ $# -ge 2 ]] || { echo "colab_setup.sh: --from needs a value" >&2; exit 2; }
                SOURCE="$2"; shift 2 ;;
        --from=*) SOURCE="${1#--from=}"; shift ;;
        --flash) FLASH=1; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        --python) [[ $# -ge 2 ]] || { echo "colab_setup.sh: --python needs a value" >&2; exit 2; }
                  PY="$2"; shift 2 ;;
        --python=*) PY="${1#--python=}"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "colab_setup.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done

# Credentials inside a URL (https://user:token@host/...) are never printed.
mask() { sed -E 's#(://)[^/@[:space:]]+@#\1***@#g'; }
say() { printf '[nbkit-setup] %s\n' "$*" | mask; }

# Print a command (shell-quoted, after "+ "), then run it unless --dry-run.
run() {
    { printf '+'; printf ' %q' "$@"; printf '\n'; } | mask
    if [[ $DRY_RUN -eq 0 ]]; then
        "$@"
    fi
}

# ---- the Python to install into --------------------------------------------------------------------------------
if [[ -z "$PY" ]]; then
    if command -v python3 >/dev/null 2>&1; then PY=python3
    elif command -v python >/dev/null 2>&1; then PY=python
    else echo "colab_setup.sh: no python3 or python on PATH (use --python)" >&2; exit 1
    fi
fi
command -v "$PY" >/dev/null 2>&1 || { echo "colab_setup.sh: python '$PY' not found" >&2; exit 1; }

# ---- where nbkit comes from ---------------------------------------------------------------------------------------
case "$SOURCE" in
    pypi) NBKIT_REQ="nbkit" ;;
    git+*) NBKIT_REQ="nbkit @ $SOURCE" ;;
    *://*) echo "colab_setup.sh: --from $(printf '%s' "$SOURCE" | mask): use a git+https:// URL, a local path or a requirement" >&2; exit 2 ;;
    *)
        if [[ -d "$SOURCE" ]]; then
            [[ -f "$SOURCE/pyproject.toml" ]] || { echo "colab_setup.sh: $SOURCE has no pyproject.toml" >&2; exit 2; }
            NBKIT_REQ="$(cd "$SOURCE" && pwd)"
        elif [[ "$SOURCE" == nbkit* ]]; then
            NBKIT_REQ="$SOURCE"
        else
            echo "colab_setup.sh: --from $SOURCE: no such directory, and not a requirement for nbkit" >&2; exit 2
        fi ;;
esac

# ---- platform ------------------------------------------------------------------------------------------------------
detect_platform() {
    if [[ -n "${COLAB_RELEASE_TAG:-}" || -n "${COLAB_GPU:-}" ]]; then
        echo colab
    elif [[ -n "${KAGGLE_KERNEL_RUN_TYPE:-}" || -n "${KAGGLE_URL_BASE:-}" ]]; then
        echo kaggle
    elif [[ -d /content ]] && "$PY" -c 'import google.colab' >/dev/null 2>&1; then
        echo colab
    else
        echo other
    fi
}
PLATFORM="$(detect_platform)"
say "platform: $PLATFORM; python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

# ---- versions (from package metadata: nothing is imported) ---------------------------------------------------------
KEY_PACKAGES="torch transformers trl peft bitsandbytes datasets accelerate ipywidgets nbkit liger-kernel flash-attn"
PINNED="torch torchvision torchaudio"  # the runtime's builds, kept as they are

versions() {
    # shellcheck disable=SC2086  # the package lists are meant to split into words
    "$PY" - $KEY_PACKAGES torchvision torchaudio <<'EOF'
import sys
from importlib import metadata
for name in sys.argv[1:]:
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "-")
EOF
}

version_of() {  # version_of NAME VERSIONS_TEXT -> the version or "-"
    awk -v n="$1" '$1 == n { print $2 }' <<<"$2"
}

BEFORE="$(versions)"

# ---- pin what the runtime already has ------------------------------------------------------------------------------
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
CONSTRAINTS="$WORK/constraints.txt"
: >"$CONSTRAINTS"
TORCH_VERSION="$(version_of torch "$BEFORE")"
if [[ "$TORCH_VERSION" == "-" ]]; then
    say "WARNING: no torch in this Python: pip will install torch from PyPI for nbkit. To choose the CUDA build,"
    say "         install torch first (https://pytorch.org/get-started/locally/) and run this script again."
else
    for pkg in $PINNED; do
        v="$(version_of "$pkg" "$BEFORE")"
        if [[ "$v" != "-" ]]; then
            echo "$pkg==$v" >>"$CONSTRAINTS"
        fi
    done
    say "keeping the runtime's torch: constraints $(paste -sd' ' "$CONSTRAINTS")"
fi

PIP=("$PY" -m pip install --upgrade --upgrade-strategy only-if-needed --progress-bar off -c "$CONSTRAINTS")
say "installing nbkit from $SOURCE"
if ! run "${PIP[@]}" "$NBKIT_REQ"; then
    say "ERROR: pip failed."
    if [[ "$PLATFORM" == kaggle ]]; then
        say "On Kaggle, turn on Internet in the notebook's settings (it needs a verified phone number)."
    fi
    say "If pip reports a conflict with torch==$TORCH_VERSION, this nbkit needs another torch than the runtime has."
    exit 1
fi

# ---- GPU ----------------------------------------------------------------------------------------------------------
GPU_NAME=""
GPU_CC=""
if command -v nvidia-smi >/dev/null 2>&1; then
    line="$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null | head -n 1 || true)"
    if [[ "$line" == *,* ]]; then
        GPU_NAME="$(echo "${line%,*}" | xargs)"
        GPU_CC="$(echo "${line##*,}" | xargs)"
    fi
fi
if [[ -z "$GPU_CC" && "$TORCH_VERSION" != "-" ]]; then
    line="$("$PY" -c 'import torch
if torch.cuda.is_available():
    major, minor = torch.cuda.get_device_capability(0)
    print(f"{torch.cuda.get_device_name(0)},{major}.{minor}")' 2>/dev/null || true)"
    if [[ "$line" == *,* ]]; then
        GPU_NAME="${line%,*}"
        GPU_CC="${line##*,}"
    fi
fi
CC_MAJOR="${GPU_CC%%.*}"
if [[ -z "$GPU_CC" ]]; then
    PRECISION="fp32 (no CUDA GPU found)"
elif [[ "$CC_MAJOR" =~ ^[0-9]+$ && "$CC_MAJOR" -ge 8 ]]; then
    PRECISION="bf16"
else
    PRECISION="fp16 (no bf16 before compute capability 8.0)"
fi

# ---- flash-attn, only when asked and only as a prebuilt wheel -------------------------------------------------------
FLASH_STATUS="not requested (--flash)"
if [[ $FLASH -eq 1 ]]; then
    if [[ -z "$GPU_CC" ]]; then
        FLASH_STATUS="skipped: no CUDA GPU"
    elif ! [[ "$CC_MAJOR" =~ ^[0-9]+$ && "$CC_MAJOR" -ge 8 ]]; then
        FLASH_STATUS="skipped: flash-attn 2 needs compute capability 8.0 or newer (this GPU: $GPU_CC)"
    else
        WHEELS="$WORK/wheels"
        say "looking for a prebuilt flash-attn wheel for this runtime (no source builds)"
        if run "$PY" -m pip download --only-binary=:all: --no-deps --progress-bar off -d "$WHEELS" flash-attn; then
            if [[ $DRY_RUN -eq 1 ]]; then
                FLASH_STATUS="dry run: would install the wheel found, then check that it imports"
                run "${PIP[@]}" "$WHEELS/<the flash-attn wheel found>"
            else
                wheel="$(find "$WHEELS" -name 'flash_attn-*.whl' | head -n 1)"
                if [[ -z "$wheel" ]]; then
                    FLASH_STATUS="skipped: pip found no wheel"
                elif run "${PIP[@]}" "$wheel" && "$PY" -c 'import flash_attn' >/dev/null 2>&1; then
                    FLASH_STATUS="installed ($(basename "$wheel"))"
                else
                    run "$PY" -m pip uninstall -y flash-attn || true
                    FLASH_STATUS="skipped: the wheel does not load against torch $TORCH_VERSION (removed)"
                fi
            fi
        else
            FLASH_STATUS="skipped: no prebuilt wheel fits this runtime (nbkit works without it)"
        fi
    fi
fi

# ---- Liger-Kernel: nbkit's fused RMSNorm/SwiGLU/RoPE (fused_kernels="auto"), Triton kernels: CUDA GPUs only ----------
LIGER_STATUS="skipped: no CUDA GPU (fused_kernels stays off)"
if [[ -n "$GPU_CC" ]]; then
    if [[ $DRY_RUN -eq 1 ]]; then
        LIGER_STATUS="dry run: would install liger-kernel"
        run "${PIP[@]}" "liger-kernel>=0.8.5"
    elif run "${PIP[@]}" "liger-kernel>=0.8.5"; then
        LIGER_STATUS="installed"
    else
        LIGER_STATUS="skipped: pip could not install it (nbkit works without it, fused_kernels stays off)"
    fi
fi

# ---- report -------------------------------------------------------------------------------------------------------
echo
say "GPU: ${GPU_NAME:-none}${GPU_CC:+, compute capability $GPU_CC}"
say "precision: $PRECISION"
say "flash-attn: $FLASH_STATUS"
say "liger-kernel: $LIGER_STATUS"
if [[ $DRY_RUN -eq 1 ]]; then
    AFTER="$BEFORE"
    say "dry run: nothing was installed; versions as found:"
else
    AFTER="$(versions)"
    say "versions:"
fi
CHANGED=()
for pkg in $KEY_PACKAGES; do
    before="$(version_of "$pkg" "$BEFORE")"
    after="$(version_of "$pkg" "$AFTER")"
    if [[ "$before" == "$after" ]]; then
        printf '    %-13s %s\n' "$pkg" "$after"
    else
        printf '    %-13s %s (was %s)\n' "$pkg" "$after" "$before"
        if [[ "$before" != "-" ]]; then
            CHANGED+=("$pkg $before -> $after")
        fi
    fi
done
if [[ "$TORCH_VERSION" != "-" && "$(version_of torch "$AFTER")" != "$TORCH_VERSION" ]]; then
    say "ERROR: torch changed from $TORCH_VERSION to $(version_of torch "$AFTER")"
    exit 1
fi
if [[ $DRY_RUN -eq 1 ]]; then
    say "restart needed: unknown until something is installed"
    echo "NBKIT_RESTART_NEEDED=unknown"
elif [[ ${#CHANGED[@]} -gt 0 ]]; then
    changed="$(printf '%s; ' "${CHANGED[@]}")"
    say "restart needed: yes, if this runtime imported any of: ${changed%; }"
    case "$PLATFORM" in
        colab) say "Colab: Runtime > Restart session, then run the notebook from the cell after this one." ;;
        kaggle) say "Kaggle: Run > Restart & clear cell outputs, then run the notebook from the cell after this one." ;;
        *) say "restart the Python kernel before importing nbkit." ;;
    esac
    echo "NBKIT_RESTART_NEEDED=1"
else
    say "restart needed: no"
    echo "NBKIT_RESTART_NEEDED=0"
fi
