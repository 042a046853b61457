#!/usr/bin/env bash
# Captures one curl session per endpoint against a live `flowprefill serve` (port 8093):
# the output committed as docs/service/curl-session.txt. Run from the repository root after
# `cargo build --release`; it writes serve.out, serve.err and metrics.txt in the current folder.
set -u
B=${FLOWPREFILL_BIN:-target/release/flowprefill}
$B serve --listen 127.0.0.1:8093 --ranks 2 --token s3cret --queue 2 --max-body-bytes 200000 > serve.out 2> serve.err &
SP=$!
for i in $(seq 1 120); do curl -s 127.0.0.1:8093/readyz >/dev/null 2>&1 && break; sleep 0.5; done
D1="The north gate of Redwater opens with the access code 4471. The gardeners keep the key in the bakery."
D2="The harbour master of Ashwood is Lena Ortiz. She has served since the great flood and keeps the ledger."
D3="The clock tower in Kingsmead was rebuilt twice. Its bell rings at noon for the market."
run() { echo; echo "\$ $*"; eval "$@"; echo; }
run "curl -s -i 127.0.0.1:8093/healthz"
run "curl -s -i 127.0.0.1:8093/readyz"
run "curl -s -i -X POST 127.0.0.1:8093/v1/jobs -H 'Content-Type: application/json' -d '{\"documents\":[\"a\"],\"query\":\"q\"}'"
run "curl -s -H 'Authorization: Bearer s3cret' -X POST 127.0.0.1:8093/v1/jobs -H 'Content-Type: application/json' -d '{\"documents\":[\"$D1\",\"$D2\",\"$D3\"],\"query\":\"What is the access code of the north gate?\",\"method\":\"infoflow\",\"ratio\":0.15,\"reorder\":true,\"scope\":\"sparse\",\"max_tokens\":24}' | python3 -c 'import json,sys; d=json.load(sys.stdin); [d.pop(k,None) for k in (\"importance\",\"selected\",\"first_top_logits\")]; print(json.dumps(d,indent=1)[:2500])'"
run "curl -s -N -H 'Authorization: Bearer s3cret' -X POST 127.0.0.1:8093/v1/jobs -H 'Content-Type: application/json' -d '{\"documents\":[\"$D1\",\"$D2\",\"$D3\"],\"query\":\"Who is the harbour master of Ashwood?\",\"stream\":true,\"max_tokens\":16}' | cut -c1-300"
run "curl -s -H 'Authorization: Bearer s3cret' 127.0.0.1:8093/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\":\"smollm2\",\"messages\":[{\"role\":\"user\",\"content\":\"$D1\n---\n$D2\n---\n$D3\n---\nWhen does the bell in Kingsmead ring?\"}],\"max_tokens\":20}'"
run "curl -s -H 'Authorization: Bearer s3cret' 127.0.0.1:8093/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\":\"smollm2\",\"messages\":[{\"role\":\"user\",\"content\":\"$D1\n---\n$D2\n---\n$D3\n---\nWhen does the bell in Kingsmead ring?\"},{\"role\":\"assistant\",\"content\":\"At noon.\"},{\"role\":\"user\",\"content\":\"Who is the harbour master of Ashwood?\"}],\"max_tokens\":20}' | python3 -c 'import json,sys; d=json.load(sys.stdin); f=d[\"flowprefill\"]; print(json.dumps({\"answer\": d[\"choices\"][0][\"message\"][\"content\"], \"usage\": d[\"usage\"], \"n_prompt_tokens\": f[\"n_prompt_tokens\"], \"n_context_tokens\": f[\"n_context_tokens\"], \"cache_hits\": f[\"cache_hits\"], \"cache_misses\": f[\"cache_misses\"]}, indent=1))'"
run "curl -s -N -H 'Authorization: Bearer s3cret' 127.0.0.1:8093/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\":\"smollm2\",\"stream\":true,\"messages\":[{\"role\":\"user\",\"content\":\"$D1\n---\n$D2\n---\nWhat is the access code of the north gate?\"}],\"max_tokens\":10}' | head -c 1500"
run "python3 -c \"import sys,json; print(json.dumps({'documents':['x'*300000],'query':'q'}))\" | curl -s -i -H 'Authorization: Bearer s3cret' -X POST 127.0.0.1:8093/v1/jobs -H 'Content-Type: application/json' --data-binary @- | head -c 600"
run "curl -s -i -H 'Authorization: Bearer s3cret' -X POST 127.0.0.1:8093/v1/jobs -H 'Content-Type: application/json' -d '{\"documents\":[\"a\"],\"query\":'"
run "curl -s -i -H 'Authorization: Bearer s3cret' -X POST 127.0.0.1:8093/v1/jobs -H 'Content-Type: application/json' -d '{\"documents\":[\"a\"],\"query\":\"q\",\"method\":\"magic\"}'"
run "curl -s -i -H 'Authorization: Bearer s3cret' -X POST 127.0.0.1:8093/v1/jobs -H 'Content-Type: application/json' -d '{\"documents\":[\"a\"],\"query\":\"q\",\"ratio\":1.5}'"
run "curl -s -i -H 'Authorization: Bearer s3cret' -X POST 127.0.0.1:8093/v1/jobs -H 'Content-Type: application/json' -d '{\"documents\":[\"\"],\"query\":\"q\"}'"
echo; echo "\$ # queue full: 5 concurrent jobs against --queue 2"
pids=(); for i in 1 2 3 4 5; do curl -s -o /dev/null -w "job $i: HTTP %{http_code} retry-after=%header{retry-after}\n" -H 'Authorization: Bearer s3cret' -X POST 127.0.0.1:8093/v1/jobs -H 'Content-Type: application/json' -d "{\"documents\":[\"$D1 $D1 $D1 $D1\",\"$D2 $D2 $D2\"],\"query\":\"What is the access code of the north gate? $i\",\"max_tokens\":40}" & pids+=($!); done; wait "${pids[@]}"
echo; echo "\$ curl -s -H 'Authorization: Bearer s3cret' 127.0.0.1:8093/metrics   (excerpt)"
curl -s -H 'Authorization: Bearer s3cret' 127.0.0.1:8093/metrics > metrics.txt
grep -E "^flowprefill_(ttft_seconds_(count|sum)|jobs_total|errors_total|queue_depth|queue_capacity|jobs_in_flight|job_phase|job_start_time_seconds|generated_tokens_total|comm_bytes_total|selected_tokens_total|recompute_ratio_(count|sum)|chunk_cache_(hits|misses)_total|straggler_gap_seconds_(count|sum)|phase_seconds_(count|sum))" metrics.txt | head -60
echo; echo "\$ kill -TERM <serve> with a job in flight"
curl -s -o /dev/null -w "in-flight job: HTTP %{http_code}\n" -H 'Authorization: Bearer s3cret' -X POST 127.0.0.1:8093/v1/jobs -H 'Content-Type: application/json' -d "{\"documents\":[\"$D1 $D1 $D1 $D1\",\"$D2 $D2 $D2\"],\"query\":\"Where is the key kept?\",\"max_tokens\":40}" &
CP=$!
sleep 0.7; kill -TERM $SP
sleep 0.3; curl -s -o /dev/null -w "new job after SIGTERM: HTTP %{http_code} (000 = connection refused)\n" -H 'Authorization: Bearer s3cret' -X POST 127.0.0.1:8093/v1/jobs -d '{}'
wait $CP; wait $SP; echo "serve exit status: $?"
echo "--- serve stderr ---"; cat serve.err
