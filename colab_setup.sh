#!/usr/bin/env bash
# colab_setup.sh: install nbkit into the running Python of a Colab or Kaggle notebook (or any machine) without
# touching the runtime's torch.
#
# What it does, in order:
#   1. detects the platform: Colab, Kaggle or other;
#   2. records the versions of the key packages and of every other installed distribution (to tell later which
#      ones the install changed, and so whether a runtime restart is needed);
#   3. pins the torch already installed (and torchvision/torchaudio, when present) in a pip constraints file, so
#      no dependency can replace it: pip fails instead of swapping torch;
#   4. removes a distribution named "nbkit" if there is one: nbkit's distribution is named nbkit-sft (the import
#      stays `nbkit`), and "nbkit" on PyPI is an unrelated project whose files would shadow these;
#   5. installs nbkit-sft from GitHub (default), a wheel, a local checkout or any requirement for nbkit-sft, with
#      its `notebooks` extra (what the example notebooks import beyond the core: matplotlib, psutil) and versions
#      of its dependencies (transformers, trl, peft, bitsandbytes, datasets, accelerate, ipywidgets) that its own
#      metadata declares compatible, then checks that `import nbkit` finds this project;
#   6. with --flash only: installs flash-attn if a prebuilt wheel for this runtime can be downloaded (never builds it
#      from source) and it imports against the installed torch; otherwise says why it skipped it;
#   7. prints the GPU, its compute capability, bf16 or fp16, the key versions, and whether to restart the runtime.
#
# It downloads and runs no remote script. --dry-run prints every command that would change something and runs none
# of them (detection still runs). Run it from a notebook cell with:  !bash colab_setup.sh [options]

set -euo pipefail

DEFAULT_SOURCE="nbkit-sft @ git+https://github.com/nbkit/nbkit"

usage() {
    cat <<EOF
Usage: bash colab_setup.sh [--from SOURCE] [--flash] [--dry-run] [--python PYTHON]

  --from SOURCE    what to install nbkit from (its distribution is nbkit-sft; the import stays nbkit):
                   a requirement for nbkit-sft (default: "$DEFAULT_SOURCE";
                   "nbkit-sft==0.1.0" once it is on PyPI), a git URL (git+https://github.com/OWNER/nbkit[@REF]),
                   a wheel (nbkit_sft-*.whl) or a local checkout
  --flash          also install flash-attn, only if a prebuilt wheel fits this runtime (pip's index and
                   PIP_FIND_LINKS / PIP_EXTRA_INDEX_URL are searched; it is never built from source)
  --dry-run        print the commands that would install anything, run none of them
  --python PYTHON  the Python to install into (default: \$PYTHON, else python3, else python)
  -h, --help       this text
EOF
}

SOURCE="$DEFAULT_SOURCE"
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
bad_source() { printf 'colab_setup.sh: --from %s: %s\n' "$SOURCE" "$1" | mask >&2; exit 2; }
OTHER_NBKIT='"nbkit" on PyPI is an unrelated project; this one is the distribution nbkit-sft'
if [[ "$SOURCE" =~ ^nbkit[-_.]sft([^A-Za-z0-9_.-]|$) ]]; then
    NBKIT_REQ="$SOURCE"
elif [[ "$SOURCE" == git+* ]]; then
    NBKIT_REQ="nbkit-sft @ $SOURCE"
elif [[ "$SOURCE" == pypi ]]; then
    bad_source "nbkit-sft is not on PyPI yet: leave --from out (it installs \"$DEFAULT_SOURCE\")"
elif [[ "$SOURCE" =~ ^nbkit([^A-Za-z0-9_.-]|$) ]]; then
    bad_source "$OTHER_NBKIT (--from \"nbkit-sft ...\")"
elif [[ "$SOURCE" == *://* ]]; then
    bad_source "use a git+https:// URL, a wheel, a local checkout or a requirement for nbkit-sft"
elif [[ -d "$SOURCE" ]]; then
    [[ -f "$SOURCE/pyproject.toml" ]] || bad_source "this directory has no pyproject.toml"
    grep -Eq "^name *= *[\"']nbkit[-_]sft[\"']" "$SOURCE/pyproject.toml" || bad_source "not a checkout of nbkit-sft"
    NBKIT_REQ="$(cd "$SOURCE" && pwd)"
elif [[ -f "$SOURCE" && "$SOURCE" == *.whl ]]; then
    [[ "$(basename "$SOURCE")" == nbkit_sft-* ]] || bad_source "not an nbkit-sft wheel (nbkit_sft-*.whl): $OTHER_NBKIT"
    NBKIT_REQ="$(cd "$(dirname "$SOURCE")" && pwd)/$(basename "$SOURCE")"
else
    bad_source "no such directory or wheel, and not a requirement for nbkit-sft"
fi
# with the extra the notebooks need (charts, host memory): added to extras the source names, kept if named already
EXTRA=notebooks
if [[ "$NBKIT_REQ" =~ ^(nbkit[-_.]sft)[[:space:]]*\[([^]]*)\](.*)$ ]]; then
    extras="${BASH_REMATCH[2]}"
    [[ ",${extras// /}," == *",$EXTRA,"* ]] || extras="${extras:+$extras,}$EXTRA"
    NBKIT_REQ="${BASH_REMATCH[1]}[$extras]${BASH_REMATCH[3]}"
elif [[ "$NBKIT_REQ" =~ ^(nbkit[-_.]sft)(.*)$ ]]; then
    NBKIT_REQ="${BASH_REMATCH[1]}[$EXTRA]${BASH_REMATCH[2]}"
else  # a path (checkout or wheel): pip reads "PATH[extra]"
    NBKIT_REQ="${NBKIT_REQ}[$EXTRA]"
fi

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
KEY_PACKAGES="torch transformers trl peft bitsandbytes datasets accelerate ipywidgets nbkit-sft liger-kernel flash-attn"
PINNED="torch torchvision torchaudio"  # the runtime's builds, kept as they are

versions() {
    # shellcheck disable=SC2086  # the package lists are meant to split into words
    "$PY" - $KEY_PACKAGES torchvision torchaudio <<'EOF'
import sys
from importlib import metadata
sys.path[:] = [p for p in sys.path if p not in ("", ".")]  # not the working directory (a checkout's egg-info)
for name in sys.argv[1:]:
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "-")
EOF
}

# Every installed distribution, "name version" a line (names normalized as pip compares them): pip may upgrade any
# dependency on the way (on Colab: pyarrow and huggingface-hub for datasets), and one the runtime imported before
# is stale as much as a key package is.
all_versions() {
    "$PY" - <<'EOF'
import re
import sys
from importlib import metadata
sys.path[:] = [p for p in sys.path if p not in ("", ".")]  # not the working directory (a checkout's egg-info)
names = {re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower() for d in metadata.distributions()}
for name in sorted(names - {""}):
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        pass
EOF
}

version_of() {  # version_of NAME VERSIONS_TEXT -> the version or "-"
    awk -v n="$1" '$1 == n { print $2 }' <<<"$2"
}

BEFORE="$(versions)"
BEFORE_ALL=""
if [[ $DRY_RUN -eq 0 ]]; then
    BEFORE_ALL="$(all_versions)"
fi

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

# ---- a distribution named "nbkit" is not this project: remove it ---------------------------------------------------
# Both install the package directory nbkit/, so the one installed last wins `import nbkit`, and uninstalling one
# later deletes the other's files. A distribution named "nbkit" is PyPI's unrelated project, or this project under
# the name it had before it became nbkit-sft; either way it goes, and nbkit-sft is installed afresh.
other_nbkit() {
    "$PY" - <<'EOF'
import sys
from importlib import metadata
sys.path[:] = [p for p in sys.path if p not in ("", ".")]  # not the working directory (a checkout's egg-info)
try:
    dist = metadata.distribution("nbkit")
except metadata.PackageNotFoundError:
    raise SystemExit(0)
urls = " ".join([dist.metadata.get("Home-page") or ""] + (dist.metadata.get_all("Project-URL") or []))
kind = "former" if "github.com/nbkit/nbkit" in urls else "other"
print(dist.version, kind, " ".join((dist.metadata.get("Summary") or "").split())[:100])
EOF
}
OTHER="$(other_nbkit)"
if [[ -n "$OTHER" ]]; then
    read -r other_version other_kind other_summary <<<"$OTHER"
    if [[ "$other_kind" == former ]]; then
        say "found the distribution 'nbkit' $other_version: this project under its former name; replacing it"
        say "with nbkit-sft (the same import, nbkit)"
    else
        say "found the distribution 'nbkit' $other_version (${other_summary:-no summary}): an unrelated project whose"
        say "files would shadow this one's (import nbkit would load it). Removing it: $OTHER_NBKIT."
    fi
    REMOVE=(nbkit)
    if [[ "$(version_of nbkit-sft "$BEFORE")" != "-" ]]; then
        REMOVE+=(nbkit-sft)  # its files under nbkit/ may be the other's now: installed afresh below
    fi
    if ! run "$PY" -m pip uninstall -y "${REMOVE[@]}"; then
        say "ERROR: pip could not uninstall 'nbkit'. Run: $PY -m pip uninstall -y nbkit, then this script again."
        exit 1
    fi
fi

PIP=("$PY" -m pip install --upgrade --upgrade-strategy only-if-needed --progress-bar off -c "$CONSTRAINTS")
say "installing nbkit from $SOURCE, with its $EXTRA extra"
if ! run "${PIP[@]}" "$NBKIT_REQ"; then
    say "ERROR: pip failed."
    if [[ "$PLATFORM" == kaggle ]]; then
        say "On Kaggle, turn on Internet in the notebook's settings (it needs a verified phone number)."
    fi
    say "If pip reports a conflict with torch==$TORCH_VERSION, this nbkit needs another torch than the runtime has."
    exit 1
fi

# ---- `import nbkit` must find this project ---------------------------------------------------------------------------
# nbkit.setup --check (metadata and files only) run from /, so that a checkout in the working directory does not
# stand in for what was installed; when it cannot even run, `import nbkit` is not this project either.
if [[ $DRY_RUN -eq 0 ]]; then
    PY_PATH="$("$PY" -c 'import sys; print(sys.executable)')"
    if CHECK="$(cd / && "$PY_PATH" -m nbkit.setup --check 2>&1)"; then
        say "$CHECK"
    else
        say "ERROR: $(tail -n 1 <<<"$CHECK")"
        if [[ "$CHECK" != *"does not load this project"* ]]; then
            say "ERROR: import nbkit does not load this project (nbkit-sft). Run: $PY -m pip uninstall -y nbkit"
            say "       nbkit-sft, then this script again."
        fi
        exit 1
    fi
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
# the other distributions that the install changed, listed below the key ones in the same form
if [[ $DRY_RUN -eq 0 ]]; then
    AFTER_ALL="$(all_versions)"
    while read -r pkg before; do
        [[ -z "$pkg" || " $KEY_PACKAGES torchvision torchaudio " == *" $pkg "* ]] && continue
        after="$(version_of "$pkg" "$AFTER_ALL")"
        if [[ -n "$after" && "$after" != "$before" ]]; then
            printf '    %-13s %s (was %s)\n' "$pkg" "$after" "$before"
            CHANGED+=("$pkg $before -> $after")
        fi
    done <<<"$BEFORE_ALL"
fi
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
