# Sourced by hack/test.sh and hack/demo.sh: a Python virtual environment the
# project owns (hack/.venv), so PyPI packages never go into the system
# Python (Debian's is "externally managed", PEP 668).
#
#   python_venv MODULE:REQUIREMENT...
#       creates the environment if needed, installs each requirement whose
#       module does not import, and puts the environment first on PATH, e.g.
#       python_venv 'grpc:grpcio>=1.60,<2'

python_venv() {
  local venv=${KONNECTIVITY_VENV:-$PWD/hack/.venv}
  if [[ ! -x $venv/bin/python3 ]]; then
    # Debian keeps venv (ensurepip) in a package of its own.
    if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
      echo "== installing python3 and python3-venv (Debian)"
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq && apt-get install -y -qq --no-install-recommends python3 python3-venv >/dev/null
    fi
    echo "== creating the Python environment $venv"
    rm -rf "$venv"
    python3 -m venv "$venv"
  fi
  export PATH="$venv/bin:$PATH" VIRTUAL_ENV=$venv
  local wanted=() package
  for package in "$@"; do
    python3 -c "import ${package%%:*}" 2>/dev/null || wanted+=("${package#*:}")
  done
  if ((${#wanted[@]})); then
    echo "== installing ${wanted[*]} (PyPI, into $venv)"
    python3 -m pip install --quiet --disable-pip-version-check "${wanted[@]}"
  fi
}
