package main

import (
	"bytes"
	"strings"
	"testing"

	"attnserve/client/go/attnservetest"
)

const serverConfig = `
pools { name: "gqa" kind: POOL_KIND_GQA num_layers: 2 page_size: 16 num_qo_heads: 8
        num_kv_heads: 2 head_dim: 64 num_pages: 256 }
pools { name: "mla" kind: POOL_KIND_MLA num_layers: 2 page_size: 64 num_qo_heads: 16
        num_pages: 32 }`

// The example runs end to end against the real server and its own checks pass.
func TestSchedulerPasses(t *testing.T) {
	srv := attnservetest.StartT(t, serverConfig)
	for _, args := range [][]string{
		{"--pool=gqa", "--sequences=3", "--prompt-len=100", "--chunk=32", "--decode-steps=4"},
		{"--pool=mla", "--sequences=2", "--prompt-len=80", "--chunk=48", "--decode-steps=2", "--seed=3"},
	} {
		var out, errOut bytes.Buffer
		code := run(append([]string{"--address=" + srv.Address}, args...), &out, &errOut)
		t.Logf("scheduler %v:\n%s%s", args, out.String(), errOut.String())
		if code != 0 || !strings.Contains(out.String(), "RESULT: PASS") {
			t.Fatalf("scheduler %v exited %d", args, code)
		}
	}
}

func TestSchedulerReportsFailedCalls(t *testing.T) {
	srv := attnservetest.StartT(t, serverConfig)
	var out, errOut bytes.Buffer
	code := run([]string{"--address=" + srv.Address, "--pool=nope"}, &out, &errOut)
	if code != 2 || !strings.Contains(errOut.String(), "no pool") {
		t.Fatalf("exit %d, stderr %q", code, errOut.String())
	}
	if code := run([]string{"--chunk=0"}, &out, &errOut); code != 2 {
		t.Fatalf("bad flag: exit %d", code)
	}
	errOut.Reset()
	if code := run([]string{"--transport=cuda"}, &out, &errOut); code != 2 || !strings.Contains(errOut.String(), "Python") {
		t.Fatalf("--transport=cuda: exit %d, stderr %q", code, errOut.String())
	}
	// Over bytes explicitly (shm needs a server with regions: e2e/dataplane_test.go).
	var ok bytes.Buffer
	if code := run([]string{"--address=" + srv.Address, "--pool=gqa", "--transport=bytes", "--prompt-len=20",
		"--decode-steps=1"}, &ok, &errOut); code != 0 || !strings.Contains(ok.String(), "RESULT: PASS") {
		t.Fatalf("--transport=bytes: exit %d\n%s%s", code, ok.String(), errOut.String())
	}
}
