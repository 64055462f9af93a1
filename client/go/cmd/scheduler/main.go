// Command scheduler is a toy scheduler driving attnserve the way an inference engine would,
// checking every result.
//
// It learns the pool's geometry from GetServerInfo, allocates pages for a few sequences of
// different prompt lengths, prefills all prompts over every layer in chunks (each Prefill call
// batches the next chunk of every unfinished sequence and appends that chunk's K/V, so later
// chunks attend to earlier ones), runs decode steps over all layers for all sequences together,
// frees the pages, and compares every output and lse with the float64 reference (package
// reference). Its pages belong to an explicit session, closed at the end.
//
// With --plan every step (a prefill round or a decode step) puts its page table, after the
// step's appends, into a plan (CreatePlan; attention.proto, "Plans") named "step"
// (attnserve.DefaultPlanName) once, and every layer's call of the step names it instead of
// carrying the table. Each step's plan replaces the previous step's under that name, so the
// server never holds more than one; the last is released (ReleasePlan) before the pages are
// freed, since a plan's pins keep FreePages from them.
//
//	scheduler --address=127.0.0.1:50051 --pool=gqa --sequences=3 --prompt-len=200 --chunk=64
//
// Exit status: 0 when every element is within tolerance and no page leaked, 1 otherwise, 2 when
// a call failed. (The leak check compares the pool's free pages before and after, so run it
// alone on its pool.)
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc/codes"

	"attnserve/client/go/attnserve"
	"attnserve/client/go/internal/stats"
	"attnserve/client/go/reference"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

type config struct {
	address     string
	pool        string
	sequences   int
	promptLen   int
	chunk       int
	decodeSteps int
	seed        int64
	plan        bool
	timeout     time.Duration
	transport   attnserve.Transport
}

func parseFlags(args []string, stderr io.Writer) (config, error) {
	var c config
	fs := flag.NewFlagSet("scheduler", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.address, "address", "127.0.0.1:50051", "server host:port")
	fs.StringVar(&c.pool, "pool", "", "pool name ('' = the server's only pool)")
	fs.IntVar(&c.sequences, "sequences", 3, "number of sequences")
	fs.IntVar(&c.promptLen, "prompt-len", 200, "longest prompt; prompt lengths are drawn from [prompt-len/4, prompt-len]")
	fs.IntVar(&c.chunk, "chunk", 64, "prefill chunk (tokens)")
	fs.IntVar(&c.decodeSteps, "decode-steps", 8, "decode steps")
	fs.Int64Var(&c.seed, "seed", 0, "random seed")
	fs.BoolVar(&c.plan, "plan", false, "each step's page table goes into a plan (CreatePlan) named \"step\" "+
		"that every layer's call of the step names instead of the table; the next step's plan replaces "+
		"it, and the last is released before the pages are freed")
	fs.DurationVar(&c.timeout, "timeout", 60*time.Second, "deadline of each call")
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
	case c.sequences < 1 || c.promptLen < 1 || c.chunk < 1:
		return c, errors.New("--sequences, --prompt-len and --chunk must be >= 1")
	case c.decodeSteps < 0:
		return c, errors.New("--decode-steps must be >= 0")
	}
	return c, nil
}

// run is main without the exit, so the tests can call it.
func run(args []string, stdout, stderr io.Writer) int {
	cfg, err := parseFlags(args, stderr)
	if err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(stderr, "scheduler:", err)
		}
		return 2
	}
	client, err := attnserve.Dial(cfg.address, attnserve.WithTimeout(cfg.timeout), attnserve.WithTransport(cfg.transport))
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 2
	}
	defer client.Close()
	code, err := schedule(context.Background(), cfg, client, stdout)
	if err != nil {
		fmt.Fprintf(stderr, "call failed: %v\n", err)
		return 2
	}
	return code
}

// scheduler drives one pool: random tokens in, attention out, each call checked.
type scheduler struct {
	client *attnserve.Client
	pool   attnserve.PoolInfo
	table  *attnserve.PageTable[int] // sequence id -> pages
	mirror *reference.Mirror         // our copy of every K/V we appended
	rng    *rand.Rand
	plans  bool            // --plan
	plan   *attnserve.Plan // the current step's (--plan), until released

	latency   map[string][]time.Duration // client round trip per op
	server    map[string][]attnserve.Timings
	checks    map[string][]reference.CloseResult // "output", "lse"
	rounds    int                                // chunked prefill rounds
	planned   int                                // plans created (--plan)
	peakPages int
}

func schedule(ctx context.Context, cfg config, client *attnserve.Client, out io.Writer) (int, error) {
	info, err := client.ServerInfo(ctx)
	if err != nil {
		return 0, err
	}
	pool, err := info.Pool(cfg.pool)
	if err != nil {
		return 0, err
	}
	mirror, err := reference.ForPool(pool)
	if err != nil {
		return 0, err
	}
	rng := rand.New(rand.NewSource(cfg.seed))
	lo := max(1, cfg.promptLen/4)
	prompts := make([]int, cfg.sequences)
	total := 0
	for i := range prompts {
		prompts[i] = lo + rng.Intn(cfg.promptLen-lo+1)
		total += prompts[i]
	}
	fmt.Fprintf(out, "server   %s: attnserve %s, backend %s, device %s\n", cfg.address, info.Version,
		info.Backend, info.Device)
	fmt.Fprintf(out, "pool     %s\n", describePool(pool))
	how := ""
	if cfg.plan {
		how = ", a plan per step"
	}
	fmt.Fprintf(out, "workload %d sequences, prompts %v (%d tokens), chunk %d, %d decode steps%s\n",
		cfg.sequences, prompts, total, cfg.chunk, cfg.decodeSteps, how)

	// An explicit session owns the pages: they survive a reconnect, and closing the session
	// frees whatever is left even if the run stops half-way. (Servers without sessions answer
	// UNIMPLEMENTED; the connection's implicit session then owns them.)
	sess, err := client.OpenSession(ctx, attnserve.SessionOptions{Lease: time.Minute})
	switch {
	case err == nil:
		client = client.WithSession(sess.ID)
		defer func() {
			if _, err := client.CloseSession(context.Background(), sess.ID); err != nil {
				fmt.Fprintln(out, "closing the session:", err)
			}
		}()
	case attnserve.Code(err) != codes.Unimplemented:
		return 0, err
	}

	s := &scheduler{
		client: client, pool: pool, mirror: mirror, rng: rng, plans: cfg.plan,
		table:   attnserve.NewPageTable[int](client, pool.Name, pool.PageSize),
		latency: map[string][]time.Duration{}, server: map[string][]attnserve.Timings{},
		checks: map[string][]reference.CloseResult{},
	}
	ids := make([]int, len(prompts))
	for i := range ids {
		ids[i] = i
	}
	runErr := s.prefill(ctx, prompts, cfg.chunk)
	if runErr == nil {
		runErr = s.decode(ctx, ids, cfg.decodeSteps)
	}
	// Release the last step's plan, whose pins keep FreePages from its pages, then free whatever
	// was allocated, also after a failed call.
	if s.plan != nil {
		if err := s.client.ReleasePlan(ctx, s.plan.Name); err != nil && runErr == nil {
			runErr = err
		}
		s.plan = nil
	}
	if err := s.table.FreeAll(ctx); err != nil && runErr == nil {
		runErr = err
	}
	if runErr != nil {
		return 0, runErr
	}
	after, err := client.Pool(ctx, pool.Name)
	if err != nil {
		return 0, err
	}
	leaked := after.FreePages != pool.FreePages

	fmt.Fprintf(out, "pages    %d allocated; free %d before, %d after -> %s\n", s.peakPages,
		pool.FreePages, after.FreePages, map[bool]string{true: "LEAK", false: "OK"}[leaked])
	fmt.Fprintf(out, "calls    prefill %d (%d chunked rounds x %d layers), decode %d (%d steps x %d layers)\n",
		len(s.server["prefill"]), s.rounds, pool.NumLayers, len(s.server["decode"]), cfg.decodeSteps,
		pool.NumLayers)
	if cfg.plan {
		fmt.Fprintf(out, "plans    %d created (one per step, each replacing the last), the last released\n",
			s.planned)
	}
	fmt.Fprintln(out, "check    tolerance: fails only if |x-ref| > 1e-2 and |x-ref|/|ref| > 1e-2")
	passed := true
	for _, name := range []string{"output", "lse"} {
		failed, elements, worst := 0, 0, 0.0
		for _, c := range s.checks[name] {
			failed += c.NumFailed
			elements += c.NumElements
			if c.MaxAbsErr > worst || math.IsNaN(c.MaxAbsErr) {
				worst = c.MaxAbsErr
			}
		}
		verdict := "PASS"
		if failed > 0 {
			verdict, passed = "FAIL", false
		}
		fmt.Fprintf(out, "         %-7s max abs err %.2e, %d of %d elements outside tolerance -> %s\n",
			name+":", worst, failed, elements, verdict)
	}
	fmt.Fprintf(out, "latency  ms, p50 / p99     %-21s%-21s%-21s%s\n", "client", "server queue",
		"server compute", "server total")
	for _, op := range []string{"prefill", "decode"} {
		timings := s.server[op]
		if len(timings) == 0 {
			continue
		}
		var queue, compute, totalT []time.Duration
		for _, t := range timings {
			queue, compute, totalT = append(queue, t.Queue), append(compute, t.Compute), append(totalT, t.Total)
		}
		line := fmt.Sprintf("         %-18s", fmt.Sprintf("%s (%d calls)", op, len(timings)))
		for _, series := range [][]time.Duration{s.latency[op], queue, compute, totalT} {
			p := stats.Percentiles(series, 50, 99)
			line += fmt.Sprintf("%-21s", fmt.Sprintf("%8.3f / %8.3f", stats.Ms(p[0]), stats.Ms(p[1])))
		}
		fmt.Fprintln(out, strings.TrimRight(line, " "))
	}
	ok := passed && !leaked
	fmt.Fprintf(out, "RESULT: %s\n", map[bool]string{true: "PASS", false: "FAIL"}[ok])
	if !ok {
		return 1, nil
	}
	return 0, nil
}

// prefill runs chunked prefill: each round takes the next chunk of every unfinished prompt,
// reserves its tokens in the page table and runs every layer over the batch.
func (s *scheduler) prefill(ctx context.Context, prompts []int, chunk int) error {
	remaining := append([]int(nil), prompts...)
	for {
		var ids, qLens []int
		for id, n := range remaining {
			if n > 0 {
				q := min(chunk, n)
				ids, qLens = append(ids, id), append(qLens, q)
			}
		}
		if len(ids) == 0 {
			return nil
		}
		for i, id := range ids {
			if _, err := s.table.Reserve(ctx, id, qLens[i]); err != nil {
				return err
			}
			remaining[id] -= qLens[i]
		}
		s.peakPages = max(s.peakPages, s.table.NumPages())
		table, err := s.table.CSR(ids, qLens)
		if err != nil {
			return err
		}
		if err := s.allLayers(ctx, "prefill", table); err != nil {
			return err
		}
		s.rounds++
	}
}

// decode runs decode steps: one new token per sequence per step, all sequences batched.
func (s *scheduler) decode(ctx context.Context, ids []int, steps int) error {
	for step := 0; step < steps; step++ {
		for _, id := range ids {
			if _, err := s.table.Reserve(ctx, id, 1); err != nil {
				return err
			}
		}
		s.peakPages = max(s.peakPages, s.table.NumPages())
		table, err := s.table.CSR(ids, nil)
		if err != nil {
			return err
		}
		if err := s.allLayers(ctx, "decode", table); err != nil {
			return err
		}
	}
	return nil
}

func (s *scheduler) allLayers(ctx context.Context, op string, table attnserve.BatchCSR) error {
	// One page table per step: in shared memory it is written once for all layers.
	staged, err := s.client.StagePageTable(ctx, table)
	if err != nil {
		return err
	}
	defer staged.Release()
	var plan *attnserve.Plan
	if s.plans {
		// The step's plan, read from the staged table (the server copies it), replaces the last
		// step's of the same name.
		plan, err = s.client.CreatePlan(ctx, &attnserve.PlanRequest{Pool: s.pool.Name,
			Name: attnserve.DefaultPlanName, Prefill: op == "prefill", PageTable: staged})
		if err != nil {
			return err
		}
		s.plan = plan
		s.planned++
	}
	for layer := 0; layer < s.pool.NumLayers; layer++ {
		if err := s.step(ctx, op, layer, staged, plan); err != nil {
			return err
		}
	}
	return nil
}

// step sends one call with random q and new K/V, mirrors the K/V and checks the result. The call
// names plan when there is one, else carries the staged table.
func (s *scheduler) step(ctx context.Context, op string, layer int, staged *attnserve.StagedPageTable,
	plan *attnserve.Plan) error {
	table := staged.CSR
	n, h := table.TotalQ(), s.pool.NumQOHeads
	req := &attnserve.AttentionRequest{Pool: s.pool.Name, Layer: layer, PageTable: staged, ReturnLSE: true}
	if plan != nil {
		req.PageTable, req.Plan = nil, plan
	}
	newKV := map[string][]float32{}
	var q, qPE []float32
	if s.pool.Kind == attnserve.PoolKindMLA {
		const ckv, kpe = attnserve.MLACKVDim, attnserve.MLAKPEDim
		q, qPE = s.random(n*h*ckv), s.random(n*h*kpe)
		newKV["ckv"], newKV["kpe"] = s.random(n*ckv), s.random(n*kpe)
		req.Q = attnserve.BF16TensorFromFloat32(q, n, h, ckv)
		req.QPE = attnserve.BF16TensorFromFloat32(qPE, n, h, kpe)
		req.CKVNew = attnserve.BF16TensorFromFloat32(newKV["ckv"], n, ckv)
		req.KPENew = attnserve.BF16TensorFromFloat32(newKV["kpe"], n, kpe)
		req.SMScale = attnserve.SMScale(attnserve.DeepSeekV3SMScale) // MLA calls must send one
	} else {
		d, hkv := s.pool.HeadDim, s.pool.NumKVHeads
		q = s.random(n * h * d)
		newKV["k"], newKV["v"] = s.random(n*hkv*d), s.random(n*hkv*d)
		req.Q = attnserve.BF16TensorFromFloat32(q, n, h, d)
		req.KNew = attnserve.BF16TensorFromFloat32(newKV["k"], n, hkv, d)
		req.VNew = attnserve.BF16TensorFromFloat32(newKV["v"], n, hkv, d)
	}

	start := time.Now()
	var res *attnserve.AttentionResult
	var err error
	if op == "prefill" {
		res, err = s.client.Prefill(ctx, req)
	} else {
		res, err = s.client.Decode(ctx, req)
	}
	if err != nil {
		return err
	}
	s.latency[op] = append(s.latency[op], time.Since(start))
	s.server[op] = append(s.server[op], res.Timings)

	// The server wrote the new K/V into the pages; so do we, then recompute.
	if err := s.mirror.Append(layer, table, newKV); err != nil {
		return err
	}
	var refOut, refLSE []float64
	if s.pool.Kind == attnserve.PoolKindMLA {
		refOut, refLSE, err = reference.MLA(s.mirror, layer, table, q, qPE, h, float64(*req.SMScale))
	} else {
		refOut, refLSE, err = reference.GQA(s.mirror, layer, table, q, h, s.pool.HeadDim, 0)
	}
	if err != nil {
		return err
	}
	s.checks["output"] = append(s.checks["output"], reference.CheckClose(res.Output.Float32(), refOut))
	s.checks["lse"] = append(s.checks["lse"], reference.CheckClose(res.LSE.Data, refLSE))
	return nil
}

// random returns n standard-normal values rounded to bf16 (what the server will see).
func (s *scheduler) random(n int) []float32 {
	out := make([]float32, n)
	for i := range out {
		out[i] = attnserve.RoundToBF16(float32(s.rng.NormFloat64()))
	}
	return out
}

func describePool(p attnserve.PoolInfo) string {
	heads := fmt.Sprintf("%d/%d heads, head_dim %d", p.NumQOHeads, p.NumKVHeads, p.HeadDim)
	if p.Kind == attnserve.PoolKindMLA {
		heads = fmt.Sprintf("%d heads, ckv %d + kpe %d", p.NumQOHeads, p.CKVDim, p.KPEDim)
	}
	return fmt.Sprintf("%q: %v, %d layers, page_size %d, %s, %d pages", p.Name, p.Kind, p.NumLayers,
		p.PageSize, heads, p.TotalPages)
}

func min(a, b int) int {
	if a < b {
		return a
	}
	return b
}

func max(a, b int) int {
	if a > b {
		return a
	}
	return b
}
