package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"reflect"
	"strings"
	"testing"
	"time"

	"attnserve/client/go/attnserve"
	"attnserve/client/go/attnservetest"
	pb "attnserve/client/go/gen/attnservev1"
)

func TestParsePlanFlag(t *testing.T) {
	attnservetest.CheckBoolFlag(t, "plan", "--pool=mla", `named "step"`,
		func(args []string, usage io.Writer) (bool, error) {
			cfg, err := parseFlags(args, usage)
			return cfg.plan, err
		})
	if code := run([]string{"--plan", "--chunk=0"}, io.Discard, io.Discard); code != 2 {
		t.Errorf("--plan with a bad flag: exit %d", code)
	}
}

// attentionCall is what Prefill and Decode requests have in common.
type attentionCall interface {
	GetPlan() string
	GetKvIndptr() []int32
	GetKvIndices() []int32
	GetKvLastPageLen() []int32
	GetPageTable() *pb.PageTableRef
}

func carriesTable(q attentionCall) bool {
	if p, ok := q.(*pb.PrefillRequest); ok && len(p.GetQoIndptr()) > 0 {
		return true
	}
	return len(q.GetKvIndptr()) > 0 || len(q.GetKvIndices()) > 0 || len(q.GetKvLastPageLen()) > 0 ||
		q.GetPageTable() != nil
}

// Under --plan every step creates its plan "step" (a Prefill plan for a prefill round, a Decode
// plan for a decode step, over the table after the step's appends, so each decode step's table
// is new) before its layers' calls, which name it and carry no table; a step's plan replaces the
// last one (no release between steps), the last is released once before the pages are freed,
// and every result still matches the reference. Without --plan the calls carry the table.
func TestSchedulerPlan(t *testing.T) {
	// Shared memory on: --transport=auto (the MLA run) takes it.
	srv := attnservetest.StartT(t, serverConfig+`
data_plane { shared_memory: true max_regions_per_session: 8 max_region_bytes_per_session: 1073741824 }`)
	for _, args := range [][]string{
		{"--pool=gqa", "--sequences=3", "--prompt-len=100", "--chunk=32", "--decode-steps=4", "--plan",
			"--transport=bytes"},
		{"--pool=mla", "--sequences=2", "--prompt-len=80", "--chunk=48", "--decode-steps=3", "--seed=3", "--plan"},
		{"--pool=gqa", "--sequences=2", "--prompt-len=50", "--chunk=16", "--decode-steps=3", "--plan",
			"--transport=shm"},
		{"--pool=gqa", "--sequences=2", "--prompt-len=50", "--chunk=16", "--decode-steps=2"},
	} {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			cfg, err := parseFlags(append([]string{"--address=" + srv.Address}, args...), io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			var rec attnservetest.Recorder
			c, err := attnserve.Dial(cfg.address, attnserve.WithTimeout(60*time.Second),
				attnserve.WithTransport(cfg.transport), rec.Option())
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			var out bytes.Buffer
			code, err := schedule(context.Background(), cfg, c, &out)
			t.Logf("scheduler %v:\n%s", args, out.String())
			if err != nil || code != 0 || !strings.Contains(out.String(), "RESULT: PASS") {
				t.Fatalf("exit %d, %v", code, err)
			}
			pool, err := c.Pool(context.Background(), cfg.pool)
			if err != nil {
				t.Fatal(err)
			}
			steps := checkSchedulerPlans(t, rec.Calls(), cfg, pool.NumLayers)
			if summary := fmt.Sprintf("plans    %d created", steps); strings.Contains(out.String(), summary) != cfg.plan {
				t.Fatalf("the summary should say %q under --plan only", summary)
			}
			if pool.FreePages != pool.TotalPages {
				t.Fatalf("%d of %d pages free after the run", pool.FreePages, pool.TotalPages)
			}
		})
	}
}

// checkSchedulerPlans checks the run's calls and returns its steps (prefill rounds and decode
// steps).
func checkSchedulerPlans(t *testing.T, calls []attnservetest.Call, cfg config, layers int) int {
	t.Helper()
	var plan *pb.CreatePlanRequest // the current step's
	var decodeTables [][]int32     // kv_last_page_len of each decode step's plan
	steps, layer, releases, freed, unplanned := 0, layers, 0, false, 0
	for i, c := range calls {
		if c.Err != nil {
			t.Fatalf("call %d, %s, failed: %v", i, c.Method, c.Err)
		}
		switch c.Method {
		case "CreatePlan":
			q := c.Req.(*pb.CreatePlanRequest)
			switch {
			case !cfg.plan:
				t.Fatalf("a plan without --plan: %v", q)
			case layer != layers:
				t.Fatalf("call %d: a plan after %d of the step's %d layers", i, layer, layers)
			case q.Name != attnserve.DefaultPlanName:
				t.Fatalf("plan named %q", q.Name)
			case cfg.transport == attnserve.TransportSHM && q.PageTable == nil:
				t.Fatalf("--transport=shm: the plan's table was not read from shared memory: %v", q)
			case cfg.transport == attnserve.TransportBytes && len(q.KvIndptr) == 0:
				t.Fatalf("--transport=bytes: the plan has no table in the message: %v", q)
			case len(q.KvIndptr) == 0 && q.PageTable == nil:
				t.Fatalf("the plan has no table: %v", q)
			}
			if !q.Prefill && q.PageTable == nil {
				decodeTables = append(decodeTables, q.KvLastPageLen)
			}
			plan, layer = q, 0
			steps++
		case "Prefill", "Decode":
			q := c.Req.(attentionCall)
			if !cfg.plan {
				if q.GetPlan() != "" || !carriesTable(q) {
					t.Fatalf("%s without --plan: plan %q, carries a table %v", c.Method, q.GetPlan(), carriesTable(q))
				}
				unplanned++
				continue
			}
			if plan == nil || q.GetPlan() != plan.Name || carriesTable(q) || plan.Prefill != (c.Method == "Prefill") {
				t.Fatalf("call %d, %s: plan %q, carries a table %v; the step's plan %v", i, c.Method,
					q.GetPlan(), carriesTable(q), plan)
			}
			if layer++; layer > layers {
				t.Fatalf("call %d: more calls than layers over one plan", i)
			}
		case "ReleasePlan":
			releases++
			if q := c.Req.(*pb.ReleasePlanRequest); q.Name != attnserve.DefaultPlanName || layer != layers {
				t.Fatalf("call %d releases %q after %d of the step's %d layers", i, q.Name, layer, layers)
			}
		case "FreePages":
			freed = true
			if cfg.plan && releases != 1 {
				t.Fatalf("call %d frees pages before the last plan was released", i)
			}
		}
	}
	want := 0
	if cfg.plan {
		want = 1
	} else {
		steps = unplanned / layers
	}
	if releases != want || !freed || steps == 0 || layer != layers && cfg.plan {
		t.Fatalf("%d releases (want %d), pages freed %v, %d steps", releases, want, freed, steps)
	}
	// Each decode step appends a token per sequence: its table is not the last step's.
	for i := 1; i < len(decodeTables); i++ {
		if reflect.DeepEqual(decodeTables[i], decodeTables[i-1]) {
			t.Fatalf("decode steps %d and %d were planned over the same table %v", i-1, i, decodeTables[i])
		}
	}
	if cfg.plan && cfg.transport == attnserve.TransportBytes && len(decodeTables) != cfg.decodeSteps {
		t.Fatalf("%d decode plans for %d decode steps", len(decodeTables), cfg.decodeSteps)
	}
	return steps
}
