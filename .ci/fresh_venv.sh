# Sourced by the CI legs. `fresh_venv NAME` makes an empty virtual environment and activates it, so that `python`
# and `pip` are its own and the README's commands run in it word for word; `drop_venv` deletes it (a CUDA build of
# torch is several GB), and so does the end of the script.
#
# Each leg gets one because legs need different versions of the same packages: installing one leg's pins over
# another's packages once left behind a dependency the older release could not import beside it (transformers 5.25
# pulls in `kernels`, which transformers 5.1 cannot load). A fresh environment per leg, as nox or tox give each
# session, keeps one leg's packages, and whatever the machine had installed, out of the next.
#   LINEAR_MHA_CI_VENVS=DIR   make the environments under DIR (default: a new temporary folder)

_ci_venv_root=""
_ci_venv=""

drop_venv() {
    if [ -n "$_ci_venv" ]; then
        if command -v deactivate >/dev/null; then deactivate; fi
        rm -rf "$_ci_venv"
        _ci_venv=""
        hash -r
    fi
}

fresh_venv() {
    drop_venv
    if [ -z "$_ci_venv_root" ]; then
        if [ -n "${LINEAR_MHA_CI_VENVS:-}" ]; then
            _ci_venv_root=$LINEAR_MHA_CI_VENVS
            mkdir -p "$_ci_venv_root"
        else
            _ci_venv_root=$(mktemp -d "${TMPDIR:-/tmp}/linear_mha-ci.XXXXXX")
            trap 'drop_venv; rm -rf "$_ci_venv_root"' EXIT
        fi
    fi
    _ci_venv="$_ci_venv_root/$1"
    rm -rf "$_ci_venv"
    echo "== $1: a fresh environment in $_ci_venv"
    python3 -m venv "$_ci_venv"
    # shellcheck disable=SC1091
    . "$_ci_venv/bin/activate"
    hash -r
}
