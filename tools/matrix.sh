#!/usr/bin/env bash
# The native exactness tests (marker `matrix`) under CC x TAPEGRAD_MARCH, then under another OpenBLAS
# kernel family with the default compiler. Run by .ci/run after make test; MATRIX_CC and MATRIX_MARCH
# narrow it (e.g. MATRIX_CC=clang-19 MATRIX_MARCH=x86-64-v2 tools/matrix.sh). No -q here: addopts has
# one, and a second would drop pytest's closing count.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PYTEST=("$PY" -m pytest -p no:cacheprovider -n auto --dist loadfile -m matrix tests)
# The host emulation of the GPU source is built by $CXX without -march: once per compiler is enough.
GPU=(--ignore=tests/test_gpu_ops.py --ignore=tests/test_gpu_ops_more.py)
declare -A CXX_OF=([gcc-11]=g++-11 [gcc-12]=g++-12 [clang-19]=clang++-19)
CCS=(${MATRIX_CC:-gcc-11 gcc-12 clang-19})
MARCHES=(${MATRIX_MARCH:-native x86-64-v3 x86-64-v2})
failed=0
rows=()

run() {   # run NAME ENV... -- PYTEST-ARGS...
    local name=$1; shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    local t0=$SECONDS
    echo "== matrix: $name"
    if env "${envs[@]}" "$@"; then
        rows+=("| $name | passed | $((SECONDS - t0)) s |")
    else
        rows+=("| $name | FAILED | $((SECONDS - t0)) s |")
        failed=1
    fi
}

for cc in "${CCS[@]}"; do
    if ! command -v "$cc" >/dev/null; then
        rows+=("| $cc | skipped: not installed | |")
        continue
    fi
    cxx=${CXX_OF[$cc]:-g++}
    command -v "$cxx" >/dev/null || cxx=g++
    for march in "${MARCHES[@]}"; do
        extra=()
        [ "$march" = native ] || extra=("${GPU[@]}")
        run "CC=$cc TAPEGRAD_MARCH=$march" CC="$cc" CXX="$cxx" TAPEGRAD_MARCH="$march" -- "${PYTEST[@]}" "${extra[@]}"
    done
done

# OpenBLAS kernel families: the default one ran above; add Haswell where it is not the default, else
# SkylakeX where the CPU has AVX-512, else Sandybridge (AVX without FMA: another rounding of products).
core() { env "$@" "$PY" -c "from tapegrad.native.runner import blas_core; print(blas_core('float64'))"; }
default=$(core)
if [ -z "${MATRIX_CC:-}${MATRIX_MARCH:-}" ]; then
    if [ "${default,,}" != haswell ]; then
        alt=Haswell
    elif grep -qw avx512f /proc/cpuinfo; then
        alt=SkylakeX
    else
        alt=Sandybridge
    fi
    got=$(core OPENBLAS_CORETYPE=$alt)
    if [ "${got,,}" = "${alt,,}" ]; then
        run "OpenBLAS $alt (default: $default)" OPENBLAS_CORETYPE=$alt -- "${PYTEST[@]}" "${GPU[@]}"
    else
        rows+=("| OpenBLAS $alt | skipped: this CPU runs $got instead | |")
    fi
fi

echo
echo "| configuration | result | time |"
echo "|---|---|---:|"
printf '%s\n' "${rows[@]}"
exit $failed
