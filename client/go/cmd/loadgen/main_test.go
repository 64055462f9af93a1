package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"attnserve/client/go/attnservetest"
)

// Both ops run briefly against the real server, report calls and give every page back.
func TestLoadgenRuns(t *testing.T) {
	srv := attnservetest.StartT(t, `pools { name: "gqa" kind: POOL_KIND_GQA num_layers: 2
		page_size: 16 num_qo_heads: 8 num_kv_heads: 2 head_dim: 64 num_pages: 256 }`)
	dir := t.TempDir()
	for _, op := range []string{"decode", "prefill"} {
		var out, errOut bytes.Buffer
		jsonPath := filepath.Join(dir, op+".json")
		code := run([]string{"--address=" + srv.Address, "--op=" + op, "--clients=3", "--batch=2",
			"--context=100", "--prefill-tokens=16", "--fill-chunk=64", "--duration=300ms",
			"--warmup=50ms", "--json=" + jsonPath}, &out, &errOut)
		t.Logf("loadgen %s:\n%s%s", op, out.String(), errOut.String())
		if code != 0 || !strings.Contains(out.String(), "throughput") {
			t.Fatalf("loadgen %s exited %d", op, code)
		}
		data, err := os.ReadFile(jsonPath)
		if err != nil {
			t.Fatal(err)
		}
		var res Result
		if err := json.Unmarshal(data, &res); err != nil {
			t.Fatal(err)
		}
		if res.Calls == 0 || len(res.Errors) != 0 || res.ClientUs.P50 <= 0 || res.ClientUs.P99 < res.ClientUs.P50 ||
			res.Transport != "auto" {
			t.Fatalf("result %+v", res)
		}
	}
	// Every page came back: a run that needs the whole pool still fits.
	var out, errOut bytes.Buffer
	if code := run([]string{"--address=" + srv.Address, "--clients=1", "--batch=1", "--context=4096",
		"--duration=50ms", "--warmup=0s"}, &out, &errOut); code != 0 {
		t.Fatalf("whole-pool run exited %d: %s%s", code, out.String(), errOut.String())
	}
	if code := run([]string{"--transport=cuda"}, &out, &errOut); code != 1 || !strings.Contains(errOut.String(), "Python") {
		t.Fatalf("--transport=cuda exited %d: %s", code, errOut.String())
	}
	if code := run([]string{"--address=" + srv.Address, "--context=5000", "--batch=1", "--clients=1"}, &out, &errOut); code != 1 ||
		!strings.Contains(errOut.String(), "need 313 pages") {
		t.Fatalf("over-capacity run exited %d: %s", code, errOut.String())
	}
}
