# Sourced by hack/test.sh: what the test suite left running.
#
#   leftover_processes DIR
#       lists every process whose working directory is DIR or under it (the
#       tests crate's directory: cargo runs the tests there, and whatever a
#       test starts inherits it, nginx's workers in deleted network
#       namespaces included), kills them, and returns 1 if there were any.
#       The processes of this shell and its ancestors are left out.

leftover_processes() {
  local dir pid cwd found=()
  dir=$(realpath "$1")
  local keep=" $$ "
  pid=$$
  while [[ $pid -gt 1 ]]; do
    pid=$(awk '{print $4}' "/proc/$pid/stat" 2>/dev/null) || break
    keep+="$pid "
  done
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    [[ $keep == *" $pid "* ]] && continue
    cwd=$(readlink "/proc/$pid/cwd" 2>/dev/null) || continue
    [[ $cwd == "$dir" || $cwd == "$dir"/* ]] || continue
    found+=("$pid")
  done
  ((${#found[@]})) || return 0
  echo "hack/test.sh: the tests left ${#found[@]} process(es) running (working directory under $dir):" >&2
  for pid in "${found[@]}"; do
    echo "  $pid $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | sed 's/ *$//')" >&2
  done
  kill -KILL "${found[@]}" 2>/dev/null || true
  echo "hack/test.sh: killed them; a test that starts a program must stop it and whatever it forked" >&2
  return 1
}
