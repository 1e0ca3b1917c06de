#!/usr/bin/env bash
# Captures what ddp-up meets on a real NVIDIA GPU, as test data (run on the GPU machine, from the
# repository's root; `capture.sh verify` reruns only the runs that fixes changed, `capture.sh warm`
# times warm start against cold there: ddp-check --gpus, a job, a restart, launch()). Everything lands
# in /tmp/cap, packed to $OUT/cap.tgz. Each step is bounded.
set -u
export PYTHONUNBUFFERED=1 COLUMNS=120
C=/tmp/cap; rm -rf $C; mkdir -p $C/torch-dumps $C/records
D=tests/data/gpu
trap 'tar czf "${OUT:-/tmp}/cap.tgz" -C /tmp cap' EXIT
step() {  # step NAME SECONDS CMD...: output to $C/NAME.txt, exit status and seconds to $C/steps.txt
  local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout -k 5 "$limit" "$@" >"$C/$name.txt" 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" >>$C/steps.txt
  tar czf "${OUT:-/tmp}/cap.tgz" -C /tmp cap  # each step's, in case the whole run is stopped
  echo "== $name rc=$rc"; tail -n 5 "$C/$name.txt"
}
Q_GPUS="--query-gpu=index,uuid,utilization.gpu,memory.used,memory.total --format=csv,noheader,nounits"
Q_APPS="--query-compute-apps=gpu_uuid,pid,used_memory,process_name --format=csv,noheader,nounits"

if [ "${1:-}" = verify ]; then  # after fixes: the runs whose output changed, again
  step install 240 python3 -m pip install --no-deps --no-build-isolation -e .
  step job 180 ddp-up --no-dashboard --runs-dir $C/runs configs/local-gpus.yaml examples/train.py --steps 5
  step shared 120 ddp-up --no-dashboard --no-preflight --runs-dir $C/runs $D/shared.yaml $D/nccl_shared.py
  step check_collective 180 ddp-check --collective configs/local-gpus.yaml
  cat $C/steps.txt; exit 0
fi

if [ "${1:-}" = warm ]; then  # warm start on the GPU, each cold run beside it with warm: false
  step install 240 python3 -m pip install --no-deps --no-build-isolation -e .
  step facts 60 bash -c "nproc; nvidia-smi -L; python3 -c 'import torch; print(torch.__version__, torch.version.cuda)'"
  stamped() {  # CMD...: its output, each line with the seconds since it was started
    local t0=${EPOCHREALTIME/./} line
    at() { local d=$((${EPOCHREALTIME/./} - t0)); printf '+%3d.%02d' $((d / 1000000)) $((d % 1000000 / 10000)); }
    "$@" 2>&1 | while IFS= read -r line; do echo "$(at) $line"; done
    echo "$(at) exit ${PIPESTATUS[0]}"
  }
  export -f stamped; S=(bash -c 'stamped "$@"' stamped)
  G=${G:-configs/local-gpus.yaml}
  if [ ! -d /proc/driver/nvidia/gpus ] && [ "$G" = configs/local-gpus.yaml ]; then  # as below
    sed "s/gpus: auto/gpus: $(nvidia-smi -L | grep -c '^GPU')/" $G >$C/gpus.yaml; G=$C/gpus.yaml
  fi
  sed 's/^transport: local$/transport: local\nwarm: false/' $G >$C/cold.yaml
  for i in 1 2 3; do  # ddp-check --gpus, warm and cold in turn
    step gpus_warm_$i 120 "${S[@]}" ddp-check --gpus --json $G
    step gpus_cold_$i 120 "${S[@]}" ddp-check --gpus --json $C/cold.yaml
  done
  step gpus_text 120 ddp-check --gpus $G
  for i in 1 2; do  # a job: launch to its first NCCL all_reduce, and to its exit
    step job_warm_$i 180 "${S[@]}" ddp-up --no-dashboard --runs-dir $C/runs $G $D/nccl_first.py
    step job_cold_$i 180 "${S[@]}" ddp-up --no-dashboard --runs-dir $C/runs $C/cold.yaml $D/nccl_first.py
  done
  step restart_warm 240 "${S[@]}" ddp-up --no-dashboard --restarts 1 --runs-dir $C/runs $G $D/nccl_first.py 0
  step restart_cold 240 "${S[@]}" ddp-up --no-dashboard --restarts 1 --runs-dir $C/runs $C/cold.yaml $D/nccl_first.py 0
  step launch_twice 240 "${S[@]}" python3 $D/launch_twice.py $G $C/runs
  step lightning 240 python3 -m benchmarks.warm_trainer --repeat 2 --nodes 2 --procs 4  # CPU ranks, 16 cores
  step leftovers 30 bash -c "ps -eo pid,stat,args | grep -E 'ddp-up|ddp_up|torchrun|nccl_first|lightning' | grep -v grep
    nvidia-smi $Q_APPS"
  cat $C/steps.txt; exit 0
fi

# 1. the machine, and the project installed (its dependencies as the image has them)
step facts 60 bash -c "uname -a; which python3; python3 -V; nvidia-smi; nvidia-smi -L;
  ls -la /proc/driver/nvidia/ /proc/driver/nvidia/gpus; cat /proc/driver/nvidia/version;
  for t in podman docker apptainer singularity enroot py-spy nvidia-container-cli nvidia-ctk; do echo \"\$t: \$(command -v \$t)\"; done;
  python3 -m pip list 2>/dev/null | grep -iE 'torch|nccl|fabric|paramiko|apprise|rich|yaml|pathspec|tqdm|pytest|lightning|accelerate|transformers'"
step torch_cuda 120 python3 -c "import json, torch, torch.distributed as d
print(json.dumps(dict(torch=torch.__version__, cuda=torch.version.cuda, nccl='.'.join(map(str, torch.cuda.nccl.version())),
  available=torch.cuda.is_available(), count=torch.cuda.device_count(), name=torch.cuda.get_device_name(0),
  capability=torch.cuda.get_device_capability(0), total=torch.cuda.get_device_properties(0).total_memory,
  nccl_available=d.is_nccl_available(), gloo_available=d.is_gloo_available()), indent=1))"
step install 240 python3 -m pip install --no-deps --no-build-isolation -e .
step probe 60 python3 -c "import json, os; from orchestrator.node.attempt import checks; from orchestrator.node.probes import facts
print(json.dumps(dict(probe=checks.probe_torch(dict(os.environ)), gpus=facts.count_gpus(dict(os.environ)),
  has_nvidia=facts.has_nvidia_gpus(), usage=facts.query_usage(), busy=facts.query_busy_gpus(None, 1)), indent=1))"
step smi_idle 30 bash -c "nvidia-smi $Q_GPUS; echo ---; nvidia-smi $Q_APPS; echo ---; nvidia-smi --query-gpu=index,uuid,utilization.gpu,memory.used,memory.total --format=csv"

# 2. which buffer variable this torch's NCCL recorder reads
step fr_vars_both 90 env TORCH_FR_BUFFER_SIZE=256 TORCH_NCCL_TRACE_BUFFER_SIZE=256 PORT=29611 python3 $D/fr_vars.py
step fr_vars_fr 90 env TORCH_FR_BUFFER_SIZE=256 PORT=29612 python3 $D/fr_vars.py
step fr_vars_nccl 90 env TORCH_NCCL_TRACE_BUFFER_SIZE=256 PORT=29613 python3 $D/fr_vars.py

# gpus: auto reads /proc/driver/nvidia/gpus; where a VM lacks it, the jobs still run with the count
G=configs/local-gpus.yaml H=$D/hang.yaml
if [ ! -d /proc/driver/nvidia/gpus ]; then
  n=$(nvidia-smi -L | grep -c '^GPU'); echo "no /proc/driver/nvidia/gpus: gpus: $n" >>$C/steps.txt
  sed "s/gpus: auto/gpus: $n/" $G >$C/gpus.yaml; sed "s/gpus: auto/gpus: $n/" $H >$C/hang.yaml; G=$C/gpus.yaml H=$C/hang.yaml
fi

# 3. real jobs: NCCL all_reduce with gpus: auto; the dashboard; two ranks on one GPU; a hang
step dryrun 60 ddp-up --dry-run $G examples/train.py --steps 5
step job 180 ddp-up --no-dashboard --runs-dir $C/runs $G examples/train.py --steps 5
step job_dashboard 180 ddp-up --dashboard --runs-dir $C/runs $G examples/train.py --steps 30 --step-time 0.4
step shared 120 ddp-up --no-dashboard --no-preflight --runs-dir $C/runs $D/shared.yaml $D/nccl_shared.py
( while sleep 1; do find /tmp/ddp-up-* \( -name 'nccl.*.json' -o -name 'fr.*.json' \) -exec cp {} $C/records/ \; 2>/dev/null; done ) &
copier=$!
step hang 180 ddp-up --no-dashboard --runs-dir $C/runs $H $D/nccl_hang.py
kill $copier

# 4. a GPU another process holds: nvidia-smi, ddp-check, ddp-up's preflight
python3 $D/hold.py $C/held.flag & holder=$!
for i in $(seq 120); do [ -f $C/held.flag ] && break; sleep 0.5; done
step smi_busy 30 bash -c "echo holder pid $holder; nvidia-smi $Q_GPUS; echo ---; nvidia-smi $Q_APPS; echo ---; nvidia-smi"
step check_busy 120 ddp-check $G
step up_busy 120 ddp-up --no-dashboard --runs-dir $C/runs $G examples/train.py
step up_busy_allowed 180 ddp-up --no-dashboard --allow-busy-gpus --runs-dir $C/runs $G examples/train.py
kill $holder 2>/dev/null; wait $holder 2>/dev/null

# 5. ddp-check --collective with NCCL
step check_collective 180 ddp-check --collective $G

# 6. containers, where a runtime with GPU support is there
if command -v podman >/dev/null || command -v docker >/dev/null; then
  step containers 60 bash -c "podman info 2>&1 | head -30; docker info 2>&1 | head -30; ls /etc/cdi /var/run/cdi 2>&1"
fi
step leftovers 30 bash -c "ps -eo pid,args | grep -E 'torchrun|torch.distributed|ddp_up|nccl_hang|hold.py' | grep -v grep; nvidia-smi $Q_APPS; ls -la /tmp/ddp-up-*"
cat $C/steps.txt
