package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"attnserve/client/go/attnserve"
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

// failing makes every call of the method fail with FAILED_PRECONDITION (not retried) before it
// reaches the server.
func failing(method string) attnserve.Option {
	return attnserve.WithDialOptions(grpc.WithUnaryInterceptor(func(ctx context.Context, m string,
		req, reply interface{}, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if path.Base(m) == method {
			return status.Error(codes.FailedPrecondition, "injected "+method+" failure")
		}
		return invoker(ctx, m, req, reply, cc, opts...)
	}))
}

// A run whose pages cannot be freed at the end leaves them held on the server: it fails, saying
// why on stderr, even though its calls went through.
func TestLoadgenFailedCleanupFails(t *testing.T) {
	srv := attnservetest.StartT(t, `pools { name: "gqa" kind: POOL_KIND_GQA num_layers: 2
		page_size: 16 num_qo_heads: 8 num_kv_heads: 2 head_dim: 64 num_pages: 256 }`)
	args := []string{"--address=" + srv.Address, "--clients=2", "--batch=1", "--context=40",
		"--duration=50ms", "--warmup=0s"}
	var out, errOut bytes.Buffer
	code := run(args, &out, &errOut, failing("FreePages"))
	t.Logf("loadgen %v:\n%s%s", args, out.String(), errOut.String())
	if !strings.Contains(out.String(), "throughput") {
		t.Fatalf("the run itself did not complete")
	}
	if code == 0 {
		t.Fatalf("loadgen exited 0 although its pages were not freed")
	}
	for _, want := range []string{"cleanup failed", "client 0: freeing pages", "client 1: freeing pages",
		"injected FreePages failure"} {
		if !strings.Contains(errOut.String(), want) {
			t.Fatalf("stderr does not say %q: %s", want, errOut.String())
		}
	}
}
