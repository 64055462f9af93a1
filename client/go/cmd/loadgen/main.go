// Command loadgen drives a running attnserve server with N concurrent clients and prints
// throughput and latency percentiles, client-side and as the server measured them.
//
//	loadgen --address=127.0.0.1:50051 --pool=gqa --op=decode --clients=8 --batch=8 \
//	        --context=1024 --duration=10s
//
// Each client has its own connection (unless --shared-conn) and owns --batch sequences of
// --context tokens in the pool, filled once with random K/V through chunked Prefill on layer 0.
// Then it calls Decode over them (one query row per sequence, no append, so the context stays
// fixed) or Prefill (--prefill-tokens query rows per sequence over the context, no append) back
// to back on layer 0 for --warmup (not measured) plus --duration. Failed calls are counted by
// code and the run goes on; the default retry policy applies (retries are counted too).
//
// --plan has each client check and pin its page table once (CreatePlan; attention.proto,
// "Plans") after filling its context, under the name p<client>: every call, warm-up included,
// names the plan instead of carrying or staging the table, which is what a scheduler's
// per-layer calls of one step cost. The calls append nothing, so the table is the same for the
// whole run and is planned once, never again (as attn_loadgen --plan does). The plans are
// released at the end, before the pages are freed.
//
// Exit status: 0 when the run completed with at least one successful call and gave back every
// plan and page it took, 1 otherwise (a failed cleanup leaves them held on the server).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"attnserve/client/go/attnserve"
	"attnserve/client/go/internal/stats"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

type config struct {
	address       string
	pool          string
	op            string
	clients       int
	batch         int
	context       int
	prefillTokens int
	fillChunk     int
	duration      time.Duration
	warmup        time.Duration
	timeout       time.Duration
	sharedConn    bool
	plan          bool
	jsonPath      string
	transport     attnserve.Transport
}

func parseFlags(args []string, stderr io.Writer) (config, error) {
	var c config
	fs := flag.NewFlagSet("loadgen", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.address, "address", "127.0.0.1:50051", "server host:port")
	fs.StringVar(&c.pool, "pool", "", "pool name ('' = the server's only pool)")
	fs.StringVar(&c.op, "op", "decode", "decode or prefill")
	fs.IntVar(&c.clients, "clients", 4, "concurrent clients")
	fs.IntVar(&c.batch, "batch", 8, "sequences per call")
	fs.IntVar(&c.context, "context", 1024, "tokens each sequence holds")
	fs.IntVar(&c.prefillTokens, "prefill-tokens", 128, "query rows per sequence of a prefill call (--op=prefill)")
	fs.IntVar(&c.fillChunk, "fill-chunk", 1024, "chunk of the prefill that fills the context")
	fs.DurationVar(&c.duration, "duration", 10*time.Second, "measured duration")
	fs.DurationVar(&c.warmup, "warmup", time.Second, "unmeasured calls first")
	fs.DurationVar(&c.timeout, "timeout", 30*time.Second, "deadline of each call")
	fs.BoolVar(&c.sharedConn, "shared-conn", false, "all clients share one connection")
	fs.BoolVar(&c.plan, "plan", false, "each client puts its page table into a plan (CreatePlan) once, "+
		"after the fill; every call, warm-up included, names it instead of carrying the table, and "+
		"it is released at the end. The calls append nothing, so the table never changes and is "+
		"planned once, as attn_loadgen --plan")
	fs.StringVar(&c.jsonPath, "json", "", "also write the results here as JSON")
	transport := fs.String("transport", "auto", "how tensors reach the server: auto (shared memory on this node when the server allows it), bytes or shm")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	var err error
	if c.transport, err = attnserve.ParseTransport(*transport); err != nil {
		return c, err
	}
	switch {
	case fs.NArg() > 0:
		return c, fmt.Errorf("unexpected arguments %q", fs.Args())
	case c.op != "decode" && c.op != "prefill":
		return c, fmt.Errorf("--op must be decode or prefill, got %q", c.op)
	case c.clients < 1 || c.batch < 1 || c.context < 1 || c.prefillTokens < 1 || c.fillChunk < 1:
		return c, errors.New("--clients, --batch, --context, --prefill-tokens and --fill-chunk must be >= 1")
	case c.duration <= 0 || c.warmup < 0:
		return c, errors.New("--duration must be > 0 and --warmup >= 0")
	}
	return c, nil
}

// Result is what a run measured (also the --json output).
type Result struct {
	Op              string         `json:"op"`
	Transport       string         `json:"transport"`
	Clients         int            `json:"clients"`
	Batch           int            `json:"batch"`
	Context         int            `json:"context"`
	PrefillTokens   int            `json:"prefill_tokens,omitempty"`
	Plan            bool           `json:"plan"` // --plan: the calls named a plan, not a table
	Seconds         float64        `json:"seconds"`
	Calls           int            `json:"calls"`
	Errors          map[string]int `json:"errors"`
	Retries         int64          `json:"retries"` // whole run, warmup included
	CallsPerSecond  float64        `json:"calls_per_second"`
	TokensPerSecond float64        `json:"tokens_per_second"`
	MergedPerLaunch float64        `json:"calls_merged_per_launch"`
	ClientUs        Percentiles    `json:"client_us"`
	QueueUs         Percentiles    `json:"server_queue_us"`
	ComputeUs       Percentiles    `json:"server_compute_us"`
	TotalUs         Percentiles    `json:"server_total_us"`
}

// Percentiles of one latency series, in microseconds.
type Percentiles struct {
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
	Max  float64 `json:"max"`
	Mean float64 `json:"mean"`
}

func percentiles(ds []time.Duration) Percentiles {
	p := stats.Percentiles(ds, 50, 90, 99, 100)
	return Percentiles{P50: stats.Us(p[0]), P90: stats.Us(p[1]), P99: stats.Us(p[2]), Max: stats.Us(p[3]),
		Mean: stats.Us(stats.Mean(ds))}
}

// run is main without the exit; extra options go to every client (the tests inject failures
// through them).
func run(args []string, stdout, stderr io.Writer, extra ...attnserve.Option) int {
	cfg, err := parseFlags(args, stderr)
	if err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(stderr, "loadgen:", err)
		}
		return 1
	}
	res, err := loadgen(context.Background(), cfg, stdout, extra...)
	if err != nil {
		fmt.Fprintln(stderr, "loadgen:", err)
		return 1
	}
	if cfg.jsonPath != "" {
		data, _ := json.MarshalIndent(res, "", "  ")
		if err := os.WriteFile(cfg.jsonPath, append(data, '\n'), 0o644); err != nil {
			fmt.Fprintln(stderr, "loadgen:", err)
			return 1
		}
	}
	if res.Calls == 0 {
		return 1
	}
	return 0
}

// checkPlans refuses --plan before anything is allocated when the server has no plans
// (maxPlans, DataPlane.MaxPlansPerSession, is 0) or, with --shared-conn, when the clients' plans
// all live in the connection's one session and are more than it may hold.
func checkPlans(cfg config, maxPlans int) error {
	switch {
	case !cfg.plan:
		return nil
	case maxPlans == 0:
		return errors.New("--plan: the server has no plans (GetServerInfo.data_plane.max_plans_per_session is 0)")
	case cfg.sharedConn && cfg.clients > maxPlans:
		return fmt.Errorf("--plan --shared-conn: %d clients' plans in one session, the server allows %d",
			cfg.clients, maxPlans)
	}
	return nil
}

// worker is one client: its sequences, its pre-built request, its plan (--plan) and what it
// measured.
type worker struct {
	client  *attnserve.Client
	table   *attnserve.PageTable[int]
	req     *attnserve.AttentionRequest
	plan    *attnserve.Plan // until released
	latency []time.Duration
	timings []attnserve.Timings
	errors  map[string]int
}

// loadgen runs the load; extra options go to every client after the flags' (the tests watch
// the calls through them). Plans and pages are given back at the end, also after a failure; a
// run whose cleanup fails is an error too.
func loadgen(ctx context.Context, cfg config, out io.Writer, extra ...attnserve.Option) (res *Result, err error) {
	var retries int64
	policy := attnserve.DefaultRetryPolicy()
	policy.OnRetry = func(attnserve.RetryEvent) { atomic.AddInt64(&retries, 1) }
	opts := []attnserve.Option{attnserve.WithTimeout(cfg.timeout), attnserve.WithRetryPolicy(policy),
		attnserve.WithTransport(cfg.transport)}
	opts = append(opts, extra...)
	first, err := attnserve.Dial(cfg.address, opts...)
	if err != nil {
		return nil, err
	}
	defer first.Close()
	info, err := first.ServerInfo(ctx)
	if err != nil {
		return nil, err
	}
	pool, err := info.Pool(cfg.pool)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(out, "server %s backend %s (%s); pool %s: %v, %d/%d heads, page %d, %d free pages\n",
		info.Version, info.Backend, info.Device, pool.Name, pool.Kind, pool.NumQOHeads, pool.NumKVHeads,
		pool.PageSize, pool.FreePages)
	need := cfg.clients * cfg.batch * attnserve.PagesFor(cfg.context, pool.PageSize)
	if need > pool.FreePages {
		return nil, fmt.Errorf("%d clients x %d sequences x %d tokens need %d pages, pool %s has %d free",
			cfg.clients, cfg.batch, cfg.context, need, pool.Name, pool.FreePages)
	}
	if err := checkPlans(cfg, info.DataPlane.MaxPlansPerSession); err != nil {
		return nil, err
	}

	workers := make([]*worker, cfg.clients)
	defer func() {
		if cleanupErr := cleanUp(workers, first); cleanupErr != nil {
			if err == nil {
				res, err = nil, cleanupErr
			} else {
				err = fmt.Errorf("%w; %v", err, cleanupErr)
			}
		}
	}()
	fillStart := time.Now()
	for i := range workers {
		c := first
		if !cfg.sharedConn && i > 0 {
			if c, err = attnserve.Dial(cfg.address, opts...); err != nil {
				return nil, err
			}
		}
		workers[i] = &worker{client: c, errors: map[string]int{},
			table: attnserve.NewPageTable[int](c, pool.Name, pool.PageSize)}
		if err := workers[i].setup(ctx, cfg, pool, rand.New(rand.NewSource(int64(i)))); err != nil {
			return nil, err
		}
		if cfg.plan {
			if err := workers[i].createPlan(ctx, cfg, pool, fmt.Sprintf("p%d", i), out); err != nil {
				return nil, err
			}
		}
	}
	fmt.Fprintf(out, "filled %d sequences x %d tokens in %.1f s\n", cfg.clients*cfg.batch, cfg.context,
		time.Since(fillStart).Seconds())

	start := time.Now()
	measureFrom, end := start.Add(cfg.warmup), start.Add(cfg.warmup+cfg.duration)
	var wg sync.WaitGroup
	for _, w := range workers {
		wg.Add(1)
		go func(w *worker) {
			defer wg.Done()
			w.loop(ctx, cfg.op, measureFrom, end)
		}(w)
	}
	wg.Wait()
	for _, w := range workers {
		if err := w.releasePlan(ctx); err != nil {
			return nil, fmt.Errorf("releasing the plan: %w", err)
		}
	}

	res = &Result{Op: cfg.op, Transport: string(cfg.transport), Clients: cfg.clients, Batch: cfg.batch, Context: cfg.context,
		Plan: cfg.plan, Seconds: cfg.duration.Seconds(), Errors: map[string]int{}, Retries: atomic.LoadInt64(&retries)}
	if cfg.op == "prefill" {
		res.PrefillTokens = cfg.prefillTokens
	}
	var client, queue, compute, total []time.Duration
	merged := 0
	for _, w := range workers {
		client = append(client, w.latency...)
		for _, t := range w.timings {
			queue, compute, total = append(queue, t.Queue), append(compute, t.Compute), append(total, t.Total)
			merged += t.BatchRequests
		}
		for code, n := range w.errors {
			res.Errors[code] += n
		}
	}
	res.Calls = len(client)
	tokensPerCall := cfg.batch
	if cfg.op == "prefill" {
		tokensPerCall = cfg.batch * cfg.prefillTokens
	}
	res.CallsPerSecond = float64(res.Calls) / res.Seconds
	res.TokensPerSecond = res.CallsPerSecond * float64(tokensPerCall)
	if res.Calls > 0 {
		res.MergedPerLaunch = float64(merged) / float64(res.Calls)
	}
	res.ClientUs, res.QueueUs, res.ComputeUs, res.TotalUs =
		percentiles(client), percentiles(queue), percentiles(compute), percentiles(total)
	report(out, cfg, res)
	return res, nil
}

// cleanUp releases every worker's plan, frees its pages and closes its connection (but
// first's), going on past failures. The error names each plan or page table that could not be
// given back.
func cleanUp(workers []*worker, first *attnserve.Client) error {
	var failed []string
	for i, w := range workers {
		if w == nil {
			continue
		}
		// A plan pins its pages: FreePages refuses them until it is released.
		if err := w.releasePlan(context.Background()); err != nil {
			failed = append(failed, fmt.Sprintf("client %d: releasing the plan: %v", i, err))
		}
		if err := w.table.FreeAll(context.Background()); err != nil {
			failed = append(failed, fmt.Sprintf("client %d: freeing pages: %v", i, err))
		}
		if w.client != first {
			w.client.Close()
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("cleanup failed, plans or pages may be left on the server: %s",
			strings.Join(failed, "; "))
	}
	return nil
}

// setup allocates the worker's sequences, fills their K/V on layer 0 and builds the request it
// will send over and over.
func (w *worker) setup(ctx context.Context, cfg config, pool attnserve.PoolInfo, rng *rand.Rand) error {
	for seq := 0; seq < cfg.batch; seq++ {
		for done := 0; done < cfg.context; {
			n := cfg.fillChunk
			if n > cfg.context-done {
				n = cfg.context - done
			}
			if _, err := w.table.Reserve(ctx, seq, n); err != nil {
				return err
			}
			table, err := w.table.CSR([]int{seq}, []int{n})
			if err != nil {
				return err
			}
			req := newRequest(pool, table, n, rng, true)
			if _, err := w.client.Prefill(ctx, req); err != nil {
				return fmt.Errorf("filling the context: %w", err)
			}
			done += n
		}
	}
	ids := make([]int, cfg.batch)
	for i := range ids {
		ids[i] = i
	}
	var qLens []int
	rows := cfg.batch
	if cfg.op == "prefill" {
		qLens = make([]int, cfg.batch)
		for i := range qLens {
			qLens[i] = cfg.prefillTokens
		}
		rows = cfg.batch * cfg.prefillTokens
	}
	table, err := w.table.CSR(ids, qLens)
	if err != nil {
		return err
	}
	w.req = newRequest(pool, table, rows, rng, false)
	if cfg.plan {
		return nil // createPlan replaces the table
	}
	// The table stays the same for the whole run: in shared memory it is written once.
	w.req.PageTable, err = w.client.StagePageTable(ctx, table)
	return err
}

// createPlan puts the request's page table into a plan of the client's session called name
// (--plan); the request then names it and carries no table. The calls append nothing, so the
// table holds for the whole run.
func (w *worker) createPlan(ctx context.Context, cfg config, pool attnserve.PoolInfo, name string,
	out io.Writer) error {
	start := time.Now()
	plan, err := w.client.CreatePlan(ctx, &attnserve.PlanRequest{Pool: pool.Name, Name: name,
		Prefill: cfg.op == "prefill", Table: w.req.Table})
	if err != nil {
		return fmt.Errorf("creating plan %s: %w", name, err)
	}
	fmt.Fprintf(out, "  plan %s: %d sequences, %d pages, created in %.0f us\n", plan.Name, plan.Batch,
		plan.NumPages, stats.Us(time.Since(start)))
	w.plan, w.req.Plan, w.req.Table = plan, plan, attnserve.BatchCSR{}
	return nil
}

// releasePlan releases the worker's plan, if it still has one.
func (w *worker) releasePlan(ctx context.Context) error {
	if w.plan == nil {
		return nil
	}
	name := w.plan.Name
	w.plan = nil
	return w.client.ReleasePlan(ctx, name)
}

// newRequest is a layer-0 call with random q over the table (rows query rows), with random new
// K/V when appendKV.
func newRequest(pool attnserve.PoolInfo, table attnserve.BatchCSR, rows int, rng *rand.Rand,
	appendKV bool) *attnserve.AttentionRequest {
	random := func(shape ...int) attnserve.BF16Tensor {
		n := 1
		for _, d := range shape {
			n *= d
		}
		data := make([]float32, n)
		for i := range data {
			data[i] = float32(rng.NormFloat64())
		}
		return attnserve.BF16TensorFromFloat32(data, shape...)
	}
	req := &attnserve.AttentionRequest{Pool: pool.Name, Table: table}
	h := pool.NumQOHeads
	if pool.Kind == attnserve.PoolKindMLA {
		req.Q = random(rows, h, attnserve.MLACKVDim)
		req.QPE = random(rows, h, attnserve.MLAKPEDim)
		req.SMScale = attnserve.SMScale(attnserve.DeepSeekV3SMScale)
		if appendKV {
			req.CKVNew, req.KPENew = random(rows, attnserve.MLACKVDim), random(rows, attnserve.MLAKPEDim)
		}
	} else {
		req.Q = random(rows, h, pool.HeadDim)
		if appendKV {
			req.KNew = random(rows, pool.NumKVHeads, pool.HeadDim)
			req.VNew = random(rows, pool.NumKVHeads, pool.HeadDim)
		}
	}
	return req
}

// loop sends calls back to back until end, recording those that start after measureFrom.
func (w *worker) loop(ctx context.Context, op string, measureFrom, end time.Time) {
	call := w.client.Decode
	if op == "prefill" {
		call = w.client.Prefill
	}
	for {
		start := time.Now()
		if !start.Before(end) {
			return
		}
		res, err := call(ctx, w.req)
		if start.Before(measureFrom) {
			continue
		}
		if err != nil {
			w.errors[attnserve.CodeName(attnserve.Code(err))]++
			continue
		}
		w.latency = append(w.latency, time.Since(start))
		w.timings = append(w.timings, res.Timings)
	}
}

func report(out io.Writer, cfg config, r *Result) {
	shape := fmt.Sprintf("batch %d, context %d, transport %s", cfg.batch, cfg.context, cfg.transport)
	if cfg.op == "prefill" {
		shape += fmt.Sprintf(", %d prefill tokens", cfg.prefillTokens)
	}
	if cfg.plan {
		shape += ", plan"
	}
	fmt.Fprintf(out, "%d clients x %s %s: %d calls in %.1f s\n", cfg.clients, cfg.op, shape, r.Calls, r.Seconds)
	fmt.Fprintf(out, "  throughput  %.0f calls/s, %.0f tokens/s; calls merged per launch %.2f\n",
		r.CallsPerSecond, r.TokensPerSecond, r.MergedPerLaunch)
	fmt.Fprintf(out, "  client us   p50 %.0f  p90 %.0f  p99 %.0f  max %.0f\n", r.ClientUs.P50, r.ClientUs.P90,
		r.ClientUs.P99, r.ClientUs.Max)
	fmt.Fprintf(out, "  server us   queue p50 %.0f p99 %.0f | compute p50 %.0f p99 %.0f | total p50 %.0f p99 %.0f\n",
		r.QueueUs.P50, r.QueueUs.P99, r.ComputeUs.P50, r.ComputeUs.P99, r.TotalUs.P50, r.TotalUs.P99)
	errs := "none"
	if len(r.Errors) > 0 {
		codes := make([]string, 0, len(r.Errors))
		for code := range r.Errors {
			codes = append(codes, code)
		}
		sort.Strings(codes)
		for i, code := range codes {
			codes[i] = fmt.Sprintf("%s %d", code, r.Errors[code])
		}
		errs = strings.Join(codes, ", ")
	}
	fmt.Fprintf(out, "  errors      %s (measured calls); retries %d (whole run)\n", errs, r.Retries)
}
