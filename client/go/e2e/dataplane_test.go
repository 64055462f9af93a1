package e2e

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"attnserve/client/go/attnserve"
	"attnserve/client/go/attnservetest"
)

// A server with shared-memory regions enabled; the tests skip while it answers RegisterRegion
// with UNIMPLEMENTED (a server that predates regions).
const dataPlaneConfig = serverConfig + `
data_plane { shared_memory: true max_regions_per_session: 8 max_region_bytes_per_session: 1073741824 }
`

// shmClient starts that server and returns a client of it over shared memory.
func shmClient(t *testing.T) *attnserve.Client {
	t.Helper()
	live(t) // skips without a server binary
	srv := attnservetest.StartT(t, dataPlaneConfig)
	c, err := attnserve.Dial(srv.Address, attnserve.WithTimeout(60*time.Second),
		attnserve.WithTransport(attnserve.TransportSHM))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := c.StagePageTable(context.Background(), attnserve.BatchCSR{QOIndptr: []int32{0, 1},
		KVIndptr: []int32{0, 0}, KVLastPageLen: []int32{1}}); attnserve.Code(err) == codes.Unimplemented {
		t.Skipf("the server does not support registered memory yet: %v", err)
	} else if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestSharedMemoryPrefillAndDecode(t *testing.T) {
	c := shmClient(t)
	testPrefillAndDecodeOn(t, c, "gqa", []int{37, 50, 16}, 16, 5)
	testPrefillAndDecodeOn(t, c, "mla", []int{70, 20}, 32, 3)
	regions, err := c.ListRegions(ctx())
	if err != nil || len(regions) == 0 {
		t.Fatalf("regions %v, %v: the calls did not use shared memory", regions, err)
	}
	for _, r := range regions {
		if r.CallsInFlight != 0 {
			t.Fatalf("region %s still has %d calls in flight", r.Name, r.CallsInFlight)
		}
	}
}
