package stats

import (
	"testing"
	"time"
)

func TestPercentiles(t *testing.T) {
	var ds []time.Duration
	for i := 100; i >= 1; i-- {
		ds = append(ds, time.Duration(i)*time.Millisecond)
	}
	got := Percentiles(ds, 50, 90, 99, 100, 0)
	want := []time.Duration{50, 90, 99, 100, 1}
	for i := range want {
		if got[i] != want[i]*time.Millisecond {
			t.Fatalf("percentiles %v, want %v ms", got, want)
		}
	}
	if ds[0] != 100*time.Millisecond {
		t.Fatal("input sorted in place")
	}
	if Mean(ds) != 50500*time.Microsecond || Percentiles(nil, 50)[0] != 0 || Ms(time.Second) != 1000 {
		t.Fatal("Mean / empty / Ms")
	}
}
