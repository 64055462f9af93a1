package attnserve

import "math"

// bf16 values are held as uint16 bit patterns: the upper half of an IEEE float32.

const bf16QuietNaNBit = 0x0040

// Float32ToBF16 rounds f to the nearest bf16 (ties to even) and returns its bit pattern.
// NaN stays NaN (sign and upper payload kept, quiet bit set), ±Inf stays ±Inf, and finite values
// beyond the bf16 range round to ±Inf as IEEE rounding does.
func Float32ToBF16(f float32) uint16 {
	bits := math.Float32bits(f)
	if f != f { // NaN: truncating could turn a NaN with a low payload into Inf
		return uint16(bits>>16) | bf16QuietNaNBit
	}
	lsb := (bits >> 16) & 1
	return uint16((bits + 0x7FFF + lsb) >> 16)
}

// BF16ToFloat32 widens a bf16 bit pattern to float32 (exact).
func BF16ToFloat32(b uint16) float32 {
	return math.Float32frombits(uint32(b) << 16)
}

// RoundToBF16 is f rounded to the nearest bf16, as float32: the value the server sees.
func RoundToBF16(f float32) float32 {
	return BF16ToFloat32(Float32ToBF16(f))
}

// Float32sToBF16 converts a slice with Float32ToBF16.
func Float32sToBF16(src []float32) []uint16 {
	dst := make([]uint16, len(src))
	for i, f := range src {
		dst[i] = Float32ToBF16(f)
	}
	return dst
}

// BF16sToFloat32 converts a slice with BF16ToFloat32.
func BF16sToFloat32(src []uint16) []float32 {
	dst := make([]float32, len(src))
	for i, b := range src {
		dst[i] = BF16ToFloat32(b)
	}
	return dst
}

// RoundToBF16s returns a copy of src with every element rounded to the nearest bf16.
func RoundToBF16s(src []float32) []float32 {
	dst := make([]float32, len(src))
	for i, f := range src {
		dst[i] = RoundToBF16(f)
	}
	return dst
}
