#!/usr/bin/env bash
# Run `python -m npnorm gpu-check` on a machine with an NVIDIA GPU and CuPy but no network.
#
#   bash tools/gpu_check.sh OUT_DIR [gpu-check options]
#
# First installs, offline, what that machine's Python lacks, into a temporary folder put on
# PYTHONPATH (nothing of the machine's own installation changes):
#   - array-api-compat (npnorm needs it), array-api-strict, pytest, hypothesis: from the wheels
#     in .whl/ of this repository (or $NPNORM_WHEELS), where they do not import already;
#   - npnorm itself, from this checkout, with --no-deps --no-index --no-build-isolation.
# Then runs the check from the repository root (its tests/ folder) and exits with its status:
# 0 every stage passed, 1 a stage failed, 2 no GPU, no CuPy, a missing wheel or a usage error.
# OUT_DIR gets gpu_check.md (summary first), gpu_check.json, the stages' logs and install.log.
# $PYTHON picks the interpreter (default python3). tools/README.md has the device call and the
# `pip download` line that fills .whl/.
set -uo pipefail

usage() {
    cat <<'EOF'
usage: bash tools/gpu_check.sh OUT_DIR [gpu-check options]
  OUT_DIR   folder for the report (gpu_check.md, gpu_check.json) and logs; created
  options   passed to `python -m npnorm gpu-check`: --stages tests,main,bench, --quick,
            --rounds N, --workers N, --tests-timeout S, --main-timeout S, --bench-timeout S,
            --stand-in
environment: PYTHON (default python3), NPNORM_WHEELS (default .whl/ of this repository)
EOF
}

if [ $# -lt 1 ]; then
    echo "gpu_check.sh: missing OUT_DIR" >&2
    usage >&2
    exit 2
fi
case "$1" in
    -h | --help) usage; exit 0 ;;
    -*) echo "gpu_check.sh: the first argument must be OUT_DIR, got '$1'" >&2; usage >&2; exit 2 ;;
esac

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-python3}
wheels=${NPNORM_WHEELS:-$repo/.whl}
mkdir -p "$1" || { echo "gpu_check.sh: cannot create '$1'" >&2; exit 2; }
out=$(cd "$1" && pwd)
shift
log=$out/install.log
: >"$log"
site=$(mktemp -d "${TMPDIR:-/tmp}/npnorm-gpu-check.XXXXXX")/site
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}

say() { echo "gpu_check.sh: $*" | tee -a "$log" >&2; }

if ! command -v "$py" >/dev/null 2>&1; then
    say "no Python interpreter '$py' (set PYTHON)"
    exit 2
fi
say "python: $(command -v "$py") ($("$py" -c 'import sys; print(sys.version.split()[0])'))"

# Importable from outside the checkout (so that the source tree on the path does not count).
importable() { (cd / && "$py" -c "import $1") >/dev/null 2>&1; }

pip_install() { "$py" -m pip install --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$@" >>"$log" 2>&1; }

# install_from_wheel MODULE required|optional: the one wheel of MODULE in $wheels, if MODULE is missing.
install_from_wheel() {
    local module=$1 need=$2 found
    if importable "$module"; then
        say "$module: already there"
        return 0
    fi
    found=$(find "$wheels" -maxdepth 1 -name "$module-*.whl" 2>/dev/null | sort)
    if [ -z "$found" ]; then
        if [ "$need" = required ]; then
            say "$module is missing and no wheel of it is in $wheels: bring one (tools/README.md)"
            return 1
        fi
        say "$module is missing and no wheel of it is in $wheels: going on without it"
        return 0
    fi
    if [ "$(printf '%s\n' "$found" | wc -l)" -gt 1 ]; then
        say "more than one wheel of $module in $wheels, keep one: $(echo $found)"
        return 1
    fi
    if pip_install "$found" && importable "$module"; then
        say "$module: installed from $(basename "$found")"
    else
        say "$module: installing $(basename "$found") failed (see install.log)"
        return 1
    fi
}

install_from_wheel array_api_compat required || exit 2
install_from_wheel array_api_strict optional || exit 2
install_from_wheel pytest optional || exit 2
install_from_wheel hypothesis optional || exit 2
if importable npnorm; then
    say "npnorm: already there ($(cd / && "$py" -c 'import npnorm, os; print(os.path.dirname(npnorm.__file__))'))"
elif pip_install --no-build-isolation "$repo" && importable npnorm; then
    say "npnorm: installed from $repo with --no-deps"
else
    say "npnorm: installing from $repo failed (see install.log); the check runs the source tree"
fi

cd "$repo" || exit 2
"$py" -m npnorm gpu-check "$out" "$@"
status=$?
say "gpu-check exit status $status; report: $out/gpu_check.md"
exit $status
