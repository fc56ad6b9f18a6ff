#!/usr/bin/env bash
# The interop and oracle tests under other Python x JAX pairs than .venv's (Python 3.11, JAX 0.10.2):
# one venv per row, made with pyenv's interpreter (or one on PATH), with `pip install -e .[test]` and
# that row's JAX. Run by .ci/run after make test (docs/testing.md, "Other Pythons and JAX releases").
# A row whose interpreter is absent is skipped and says so; JAX_ROWS="3.13:0.12" runs some rows only,
# JAX_ROWS_N=0 runs each row's tests on one core (default: both, one test file per worker). The venvs
# live outside the tree ($JAX_ROWS_DIR) and are reused while pyproject.toml is unchanged.
set -uo pipefail
cd "$(dirname "$0")/.."
ROWS=(${JAX_ROWS:-3.12:0.12 3.13:0.12})
DIR=${JAX_ROWS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tapegrad-rows}
# Every test that imports jax, and interop's doctests.
TESTS=(tests/test_interop*.py tests/test_oracle*.py tests/test_capture_jax.py tests/test_capture_rules.py tests/test_dropin.py
       tests/test_reliability_jax.py tests/test_reliability_oracle.py tests/test_data_parallel.py tests/test_gpu_jax.py
       tests/test_gpu_handler.py tests/test_bad_input_interop.py interop)
failed=0
rows=()

interpreter() {   # the newest pyenv python$1, else python$1 on PATH; nothing when neither exists
    local root
    root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
    local found
    found=$(ls -d "$root"/versions/"$1".*/bin/python"$1" 2>/dev/null | sort -V | tail -1)
    [ -n "$found" ] || found=$(command -v "python$1" || true)
    [ -n "$found" ] && "$found" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$1'.split('.')))" \
        2>/dev/null && echo "$found"
}

row() {   # row PYTHON JAX: make or reuse the venv, install, check the FFI handler builds, run the tests
    local py=$1 jaxv=$2 t0=$SECONDS exe venv stamp
    local name="Python $py + JAX $jaxv"
    echo "== jax rows: $name"
    exe=$(interpreter "$py")
    if [ -z "$exe" ]; then
        echo "jax rows: skipping $name: no python$py (pyenv install $py, or put python$py on PATH)"
        rows+=("| $name | skipped: no python$py | |")
        return
    fi
    venv=$DIR/py$py-jax$jaxv
    stamp=$venv/.installed-$(sha256sum pyproject.toml | cut -c1-12)
    if [ ! -e "$stamp" ]; then
        rm -rf "$venv"
        if ! { "$exe" -m venv "$venv" && "$venv/bin/python" -m pip install -q --upgrade pip &&
               "$venv/bin/python" -m pip install -q -e ".[test]" "jax==$jaxv.*" "jaxlib==$jaxv.*"; }; then
            rows+=("| $name | FAILED: install | $((SECONDS - t0)) s |")
            failed=1
            return
        fi
        touch "$stamp"
    fi
    local vpy=$venv/bin/python
    "$vpy" -c "import sys, jax, jaxlib, optax, flax, equinox; print('jax rows:', sys.version.split()[0],
               'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'optax', optax.__version__,
               'flax', flax.__version__, 'equinox', equinox.__version__)"
    # Without a built FFI handler the program tests skip: a header that no longer compiles must fail here.
    if ! "$vpy" -c "import sys; from interop.xla import program as P; P.native_library() or sys.exit(P._LIB['why'])"; then
        rows+=("| $name | FAILED: the FFI handler does not build | $((SECONDS - t0)) s |")
        failed=1
        return
    fi
    if "$vpy" -m pytest -p no:cacheprovider -n "${JAX_ROWS_N:-auto}" --dist loadfile "${TESTS[@]}"; then
        rows+=("| $name | passed | $((SECONDS - t0)) s |")
    else
        rows+=("| $name | FAILED | $((SECONDS - t0)) s |")
        failed=1
    fi
}

for r in "${ROWS[@]}"; do
    row "${r%%:*}" "${r#*:}"
done

echo
echo "| row | result | time |"
echo "|---|---|---|"
printf '%s\n' "${rows[@]}"
exit $failed
