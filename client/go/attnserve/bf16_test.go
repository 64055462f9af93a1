package attnserve

import (
	"math"
	"testing"
)

func TestFloat32ToBF16(t *testing.T) {
	cases := []struct {
		name string
		in   uint32 // float32 bits
		want uint16
	}{
		{"zero", 0x00000000, 0x0000},
		{"negative zero", 0x80000000, 0x8000},
		{"one", 0x3F800000, 0x3F80},
		{"exact", 0x3F810000, 0x3F81},
		{"below half rounds down", 0x3F807FFF, 0x3F80},
		{"above half rounds up", 0x3F808001, 0x3F81},
		{"tie to even stays", 0x3F808000, 0x3F80},
		{"tie to even goes up", 0x3F818000, 0x3F82},
		{"negative tie", 0xBF818000, 0xBF82},
		{"carry into exponent", 0x3FFFFFFF, 0x4000},
		{"largest finite rounds to inf", 0x7F7FFFFF, 0x7F80},
		{"largest bf16 stays", 0x7F7F0000, 0x7F7F},
		{"-largest rounds to -inf", 0xFF7FFFFF, 0xFF80},
		{"inf", 0x7F800000, 0x7F80},
		{"-inf", 0xFF800000, 0xFF80},
		{"subnormal", 0x00010000, 0x0001},
		{"smallest subnormal rounds to zero", 0x00000001, 0x0000},
		{"quiet nan", 0x7FC00000, 0x7FC0},
		{"nan with low payload only stays nan", 0x7F800001, 0x7FC0},
		{"negative nan keeps sign", 0xFF800001, 0xFFC0},
		{"nan payload kept", 0x7FA50000, 0x7FE5},
	}
	for _, c := range cases {
		got := Float32ToBF16(math.Float32frombits(c.in))
		if got != c.want {
			t.Errorf("%s: Float32ToBF16(%#08x) = %#04x, want %#04x", c.name, c.in, got, c.want)
		}
	}
}

func TestBF16RoundTripIsExact(t *testing.T) {
	for b := 0; b < 1<<16; b++ {
		f := BF16ToFloat32(uint16(b))
		got := Float32ToBF16(f)
		if f != f {
			if g := BF16ToFloat32(got); g == g {
				t.Fatalf("NaN %#04x came back as %v", b, g)
			}
			continue
		}
		if got != uint16(b) {
			t.Fatalf("%#04x -> %v -> %#04x", b, f, got)
		}
	}
}

func TestRoundToBF16IsNearest(t *testing.T) {
	// Every float32 in a range: the rounded value is one of the two bf16 neighbours and the
	// nearer one.
	for bits := uint32(0x3F800000); bits < 0x3F800000+1<<18; bits += 7 {
		f := math.Float32frombits(bits)
		lo := math.Float32frombits(bits &^ 0xFFFF)
		hi := math.Float32frombits((bits &^ 0xFFFF) + 0x10000)
		r := RoundToBF16(f)
		if r != lo && r != hi {
			t.Fatalf("%v rounded to %v, not %v or %v", f, r, lo, hi)
		}
		dr, dother := math.Abs(float64(r-f)), math.Abs(float64(lo+hi-r-f))
		if dr > dother {
			t.Fatalf("%v rounded to %v, %v is nearer", f, r, lo+hi-r)
		}
	}
	got := RoundToBF16s([]float32{1.00390625, 3})
	if got[0] != 1 || got[1] != 3 {
		t.Fatalf("RoundToBF16s = %v", got)
	}
	if s := BF16sToFloat32(Float32sToBF16([]float32{0.5, -2})); s[0] != 0.5 || s[1] != -2 {
		t.Fatalf("slice round trip = %v", s)
	}
}
