#!/usr/bin/env bash
# The service measurements of bench/RESULTS.md: batching efficiency, service overhead, and decode
# latency beside a long prefill with and without separate CUDA streams, and what each transport
# (bytes, shared memory, CUDA IPC) costs beyond the kernel, beside a plain socket's floor for the
# bytes scenarios. Starts the server itself.
#   bench/service_scenarios.sh [--backend=cuda|cpu] [--seconds=N] [--context=N] [--only=transports]
#                              [--match=REGEX]   (only the scenarios whose name matches)
# Needs attnserve, attn_loadgen and grpc_floor on PATH; writes JSON to $OUT (default /tmp/service-bench).
set -euo pipefail
backend=cuda seconds=5 context=4096 only="" match=""
for a in "$@"; do
  case $a in
    --backend=*) backend=${a#*=} ;;
    --seconds=*) seconds=${a#*=} ;;
    --context=*) context=${a#*=} ;;
    --only=*) only=${a#*=} ;;
    --match=*) match=${a#*=} ;;
    *) echo "unknown argument $a" >&2; exit 2 ;;
  esac
done
out=${OUT:-/tmp/service-bench}
mkdir -p "$out"
config=$(mktemp)
cat >"$config" <<EOC
pools { name: "bench" kind: POOL_KIND_GQA num_layers: 1 page_size: 16 num_qo_heads: 32
        num_kv_heads: 8 head_dim: 128 num_pages: 80000 }
data_plane { shared_memory: true cuda_ipc: true max_regions_per_session: 64
             max_region_bytes_per_session: 17179869184 max_call_queues_per_session: 16 }
EOC
transports=(bytes shm)
[ "$backend" = cuda ] && transports+=(cuda)

server=""
start_server() {  # extra flags...
  attnserve --config="$config" --backend="$backend" --listen_address=127.0.0.1:0 \
    --metrics_port=0 "$@" >"$out/server.out" 2>"$out/server.err" &
  server=$!
  for _ in $(seq 300); do
    grep -q "listening on" "$out/server.out" 2>/dev/null && break
    sleep 0.1
  done
  address=$(sed -n 's/^attnserve listening on //p' "$out/server.out")
  [ -n "$address" ] || { cat "$out/server.err"; exit 1; }
}
stop_server() { kill "$server"; wait "$server" || true; server=""; }
sock="$out/attnserve.sock"
start_unix_server() {  # extra flags...
  rm -f "$sock"
  start_server --listen_address="unix:$sock" "$@"
  address="unix:$sock"
}
# A scenario that fails (set -e) must not leave its server running.
trap '[ -z "$server" ] || kill "$server" 2>/dev/null || true' EXIT
load() {  # name, loadgen flags...
  local name=$1
  shift
  [[ -z "$match" || "$name" =~ $match ]] || return 0
  echo "== $name"
  attn_loadgen --address="$address" --context="$context" --seconds="$seconds" \
    --json="$out/$name.json" "$@"
}

start_server
if [ -z "$only" ]; then
  load single_client_b64 --clients=1 --batch=64
  load eight_clients_b8 --clients=8 --batch=8
  load decode_b64_beside_prefill --clients=1 --batch=64 --background_prefill_tokens=8192
fi
# The issue-13 targets: client latency - kernel for decode batch 64 and 256, 8 x 8 merging, and
# an 8192-token prefill on 1024 cached tokens with its K/V appended, over each transport.
for t in "${transports[@]}"; do
  load "transport_${t}_decode_b64" --clients=1 --batch=64 --transport="$t"
  load "transport_${t}_decode_b256" --clients=1 --batch=256 --transport="$t"
  load "transport_${t}_eight_clients_b8" --clients=8 --batch=8 --transport="$t"
  load "transport_${t}_prefill_8192_on_1024" --clients=1 --batch=1 --op=prefill \
    --context=1024 --prefill_tokens=8192 --append --transport="$t"
done
# The bytes path as a client on the generated stub pays it: protobuf copying every tensor into
# and out of the messages (attn_loadgen sends them as slices of their own otherwise).
load transport_bytes_protobuf_decode_b64 --clients=1 --batch=64 --transport=bytes --protobuf_bytes
load transport_bytes_protobuf_prefill_8192_on_1024 --clients=1 --batch=1 --op=prefill \
  --context=1024 --prefill_tokens=8192 --append --transport=bytes --protobuf_bytes
# The fixed cost of a call: one sequence of one page, over shared memory.
load transport_shm_floor_b1 --clients=1 --batch=1 --context=16 --transport=shm
# The Python client on attn_loadgen's decode batch 64 (needs the client's grpcio and protobuf):
# python_load NAME [client_bench args...]
python_load() {
  local name=$1
  shift
  [[ -z "$match" || "$name" =~ $match ]] || return 0
  echo "== $name"
  python3 bench/client_bench.py --address="$address" --context="$context" --seconds="$seconds" \
    --json="$out/$name.json" "$@" || echo "python client bench failed"
}
for t in bytes shm; do
  python_load "python_${t}_decode_b64" --batch=64 --transport="$t"
done
stop_server
# The same over a unix socket (what a caller on the node uses).
start_unix_server
load transport_unix_shm_decode_b64 --clients=1 --batch=64 --transport=shm
# The bytes path on the socket a caller on the node would use (TCP loopback above).
load transport_unix_bytes_decode_b64 --clients=1 --batch=64 --transport=bytes
load transport_unix_bytes_plan_decode_b64 --clients=1 --batch=64 --transport=bytes --plan
load transport_unix_bytes_prefill_8192_on_1024 --clients=1 --batch=1 --op=prefill --context=1024 \
  --prefill_tokens=8192 --append --transport=bytes
load transport_unix_shm_floor_b1 --clients=1 --batch=1 --context=16 --transport=shm
# The caller polling for its reply instead of sleeping: what waking its thread costs.
load transport_unix_shm_decode_b64_spin --clients=1 --batch=64 --transport=shm --spin
# The same calls through a shared-memory call queue per client (attention.proto, "Call queues"):
# no gRPC and no thread wake-up per call; merging with 8 clients must still hold.
load transport_queue_shm_decode_b64 --clients=1 --batch=64 --transport=shm --call_queue
load transport_queue_shm_decode_b256 --clients=1 --batch=256 --transport=shm --call_queue
load transport_queue_shm_floor_b1 --clients=1 --batch=1 --context=16 --transport=shm --call_queue
load transport_queue_shm_eight_clients_b8 --clients=8 --batch=8 --transport=shm --call_queue
if [ "$backend" = cuda ]; then
  load transport_queue_cuda_decode_b64 --clients=1 --batch=64 --transport=cuda --call_queue
  load transport_queue_cuda_prefill_8192_on_1024 --clients=1 --batch=1 --op=prefill \
    --context=1024 --prefill_tokens=8192 --append --transport=cuda --call_queue
fi
load transport_queue_shm_prefill_8192_on_1024 --clients=1 --batch=1 --op=prefill --context=1024 \
  --prefill_tokens=8192 --append --transport=shm --call_queue
# The page table checked and pinned once per step (attention.proto, "Plans"), each call naming it.
load transport_queue_shm_plan_decode_b64 --clients=1 --batch=64 --transport=shm --call_queue --plan
load transport_queue_shm_plan_decode_b256 --clients=1 --batch=256 --transport=shm --call_queue \
  --plan
load transport_queue_shm_plan_eight_clients_b8 --clients=8 --batch=8 --transport=shm \
  --call_queue --plan
if [ "$backend" = cuda ]; then
  load transport_queue_cuda_plan_decode_b64 --clients=1 --batch=64 --transport=cuda --call_queue \
    --plan
fi
load transport_bytes_plan_decode_b64 --clients=1 --batch=64 --transport=bytes --plan
# The waiting caller without the expected call time (CallQueueClient::Options::predict): it polls
# for the spin window, then sleeps until the server wakes it.
load transport_queue_shm_plan_decode_b64_nopredict --clients=1 --batch=64 --transport=shm \
  --call_queue --plan --call_queue_predict=false
load transport_queue_shm_plan_decode_b256_nopredict --clients=1 --batch=256 --transport=shm \
  --call_queue --plan --call_queue_predict=false
# The Python client on the same socket: its shm calls take a call queue by themselves.
python_load python_queue_shm_decode_b64 --batch=64 --transport=shm
python_load python_queue_shm_floor_b1 --batch=1 --context=16 --transport=shm
python_load python_queue_prepared_shm_decode_b64 --batch=64 --transport=shm --prepared
python_load python_queue_prepared_shm_floor_b1 --batch=1 --context=16 --transport=shm --prepared
python_load python_queue_prepared_plan_shm_decode_b64 --batch=64 --transport=shm --prepared --plan
python_load python_queue_prepared_plan_shm_decode_b64_nopredict --batch=64 --transport=shm \
  --prepared --plan --no_predict
stop_server

# Decode outputs in shared memory written by the kernels themselves against copied after them
# (cuda_direct_output_min_bytes: 1 = every decode's, 0 = none; the default writes those of 1 MiB
# and more; a prefill's are always copied), the same calls in both.
if [ "$backend" = cuda ]; then
  for mode in direct:1 copied:0; do
    start_unix_server --cuda_direct_output_min_bytes="${mode#*:}"
    m=${mode%%:*}
    load "transport_${m}_queue_shm_plan_decode_b64" --clients=1 --batch=64 --transport=shm \
      --call_queue --plan
    load "transport_${m}_queue_shm_plan_decode_b256" --clients=1 --batch=256 --transport=shm \
      --call_queue --plan
    load "transport_${m}_queue_shm_floor_b1" --clients=1 --batch=1 --context=16 --transport=shm \
      --call_queue
    stop_server
  done
fi

# A prefill's outputs computed in chunks, each copied out while the next is computed
# (cuda_output_chunk_bytes: the default 8 MiB against 0 = one launch, then the copies), the same
# calls in both.
if [ "$backend" = cuda ]; then
  for mode in chunked:8388608 whole:0; do
    start_unix_server --cuda_output_chunk_bytes="${mode#*:}"
    m=${mode%%:*}
    load "transport_${m}_queue_shm_prefill_8192_on_1024" --clients=1 --batch=1 --op=prefill \
      --context=1024 --prefill_tokens=8192 --append --transport=shm --call_queue
    load "transport_${m}_queue_cuda_prefill_8192_on_1024" --clients=1 --batch=1 --op=prefill \
      --context=1024 --prefill_tokens=8192 --append --transport=cuda --call_queue
    load "transport_${m}_unix_bytes_prefill_8192_on_1024" --clients=1 --batch=1 --op=prefill \
      --context=1024 --prefill_tokens=8192 --append --transport=bytes
    stop_server
  done
fi

# The floor under the bytes scenarios: the same bytes through a plain loopback socket between two
# processes, no RPC (bench/socket_floor.py), over TCP and a unix socket. The decodes of batch 64
# send q (512 KiB; attn_loadgen appends nothing to a decode) and read the output (512 KiB, no
# lse); the prefill sends q, k and v (96 MiB) and reads the output (64 MiB).
floor() {  # name, request bytes, response bytes
  local name=$1
  [[ -z "$match" || "$name" =~ $match ]] || return 0
  echo "== $name"
  rm -f "$out/$name.jsonl"
  python3 bench/socket_floor.py --request="$2" --response="$3" --seconds="$seconds" \
    --json="$out/$name.jsonl"
}
floor socket_floor_decode_b64 524288 524288
floor socket_floor_prefill_8192 100663296 67108864
# gRPC's own floor over the same sockets (bench/grpc_floor.cc): an echo of the decode's 512 KiB
# each way with attnserve's channel arguments, answered by a second thread as the batcher answers,
# the client asleep in its completion queue as attn_loadgen's is. What the bytes decodes take above
# it is attnserve's.
rpc_floor() {  # name, transport, extra flags...
  local name=$1 transport=$2
  shift 2
  [[ -z "$match" || "$name" =~ $match ]] || return 0
  echo "== $name"
  grpc_floor --transport="$transport" --request_bytes=524288 --response_bytes=524288 \
    --seconds="$seconds" --handoff --json="$out/$name.floor" "$@"
}
rpc_floor grpc_floor_decode_b64_tcp tcp
rpc_floor grpc_floor_decode_b64_unix unix

if [ "$backend" = cuda ] && [ -z "$only" ]; then
  start_server --cuda_single_stream
  load decode_b64_beside_prefill_one_stream --clients=1 --batch=64 --background_prefill_tokens=8192
  stop_server
fi
python3 - "$out" <<'EOP'
import json, sys, os
out = sys.argv[1]
r = {n[:-5]: json.load(open(os.path.join(out, n))) for n in os.listdir(out) if n.endswith(".json")}
one, eight = r.get("single_client_b64"), r.get("eight_clients_b8")
if one and eight:
    print(f"batching efficiency (8 clients x batch 8 vs 1 x 64): "
          f"{eight['tokens_per_s'] / one['tokens_per_s']:.2f} "
          f"({eight['tokens_per_s']:.0f} vs {one['tokens_per_s']:.0f} tokens/s, "
          f"{eight['merged_per_launch']:.2f} calls per launch)")
    print(f"service overhead, decode batch 64: p50 {one['server_overhead_us']['p50']:.0f} us, "
          f"p99 {one['server_overhead_us']['p99']:.0f} us (kernel p50 {one['compute_us_p50']:.0f} us); "
          f"end to end (client latency - kernel) p50 {one['end_to_end_overhead_us']['p50']:.0f} us, "
          f"p99 {one['end_to_end_overhead_us']['p99']:.0f} us")
for name in ("decode_b64_beside_prefill", "decode_b64_beside_prefill_one_stream"):
    if name in r:
        c = r[name]["client_us"]
        print(f"{name}: decode latency p50 {c['p50']:.0f} us, p99 {c['p99']:.0f} us")
print("transport scenario: client p50 us | kernel p50 us | client - kernel p50 / p99 us | "
      "client / kernel | calls merged")
for name in sorted(n for n in r if n.startswith("transport_")):
    x = r[name]
    e2e, k = x["end_to_end_overhead_us"], x["compute_us_p50"]
    print(f"  {name[10:]}: {x['client_us']['p50']:.0f} | {k:.0f} | {e2e['p50']:.0f} / "
          f"{e2e['p99']:.0f} | {x['client_us']['p50'] / max(k, 1):.2f} | "
          f"{x['merged_per_launch']:.2f}")
floors = [n for n in os.listdir(out) if n.startswith("socket_floor_") and n.endswith(".jsonl")]
for n in sorted(floors):
    for line in open(os.path.join(out, n)):
        x = json.loads(line)
        print(f"  socket floor, {n[13:-6]} over {x['transport']}: p50 {x['p50_us']:.0f} us, "
              f"p99 {x['p99_us']:.0f} us (no RPC: what every bytes call pays)")
for n in sorted(n for n in os.listdir(out) if n.endswith(".floor")):
    x = json.load(open(os.path.join(out, n)))
    print(f"  gRPC floor, decode b64 over {x['transport']}: p50 {x['p50_us']:.0f} us, "
          f"p99 {x['p99_us']:.0f} us (an echo through gRPC: what every bytes call pays)")
for t in ("bytes", "shm"):
    x, lg = r.get(f"python_{t}_decode_b64"), r.get(f"transport_{t}_decode_b64")
    if x and lg:
        e2e = x["end_to_end_overhead_us"]["p50"]
        print(f"python client, {t} decode b64: client - kernel p50 {e2e:.0f} us, "
              f"{e2e - lg['end_to_end_overhead_us']['p50']:+.0f} us against attn_loadgen")
EOP
