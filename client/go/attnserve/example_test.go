package attnserve_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"attnserve/client/go/attnserve"
)

// A scheduler's life cycle on a GQA pool: learn the geometry, prefill a prompt in chunks over
// every layer, decode, free. (Compiled by go vet / go test; it needs a running server.)
func Example() {
	ctx := context.Background()
	client, err := attnserve.Dial("127.0.0.1:50051", attnserve.WithTimeout(10*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	pool, err := client.Pool(ctx, "gqa")
	if err != nil {
		log.Fatal(err)
	}
	h, hkv, d := pool.NumQOHeads, pool.NumKVHeads, pool.HeadDim
	table := attnserve.NewPageTable[string](client, pool.Name, pool.PageSize)
	defer table.FreeAll(ctx)

	// Your model produces q, k, v per layer; zeros here.
	tensor := func(shape ...int) attnserve.BF16Tensor {
		n := 1
		for _, s := range shape {
			n *= s
		}
		return attnserve.BF16TensorFromFloat32(make([]float32, n), shape...)
	}

	// Chunked prefill of a 100-token prompt, 64 tokens per call.
	for done, chunk := 0, 64; done < 100; done += chunk {
		n := min(chunk, 100-done)
		if _, err := table.Reserve(ctx, "req-1", n); err != nil {
			if errors.Is(err, attnserve.ErrPoolExhausted) {
				log.Fatal("pool full: preempt or wait for sequences to finish")
			}
			log.Fatal(err)
		}
		csr, _ := table.CSR([]string{"req-1"}, []int{n})
		for layer := 0; layer < pool.NumLayers; layer++ {
			res, err := client.Prefill(ctx, &attnserve.AttentionRequest{
				Pool: pool.Name, Layer: layer, Table: csr,
				Q: tensor(n, h, d), KNew: tensor(n, hkv, d), VNew: tensor(n, hkv, d),
			})
			if err != nil {
				log.Fatal(err)
			}
			_ = res.Output.Float32() // [n, h, d]
		}
	}

	// One decode step: one new token per sequence.
	if _, err := table.Reserve(ctx, "req-1", 1); err != nil {
		log.Fatal(err)
	}
	csr, _ := table.CSR([]string{"req-1"}, nil)
	res, err := client.Decode(ctx, &attnserve.AttentionRequest{
		Pool: pool.Name, Layer: 0, Table: csr, ReturnLSE: true,
		Q: tensor(1, h, d), KNew: tensor(1, hkv, d), VNew: tensor(1, hkv, d),
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(res.Output.Shape, res.LSE.Shape, res.Timings.Total)
}

func min(a, b int) int {
	if a < b {
		return a
	}
	return b
}
