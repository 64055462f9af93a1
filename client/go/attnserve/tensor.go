package attnserve

import (
	"encoding/binary"
	"fmt"
	"math"

	pb "attnserve/client/go/gen/attnservev1"
)

// BF16Tensor is a dense row-major bf16 tensor held as raw bit patterns. The zero value (nil
// Shape) means "absent": optional request fields holding it are not sent.
type BF16Tensor struct {
	Shape []int
	Data  []uint16
}

// NewBF16Tensor wraps bf16 bit patterns (not copied) with a shape.
func NewBF16Tensor(data []uint16, shape ...int) BF16Tensor {
	return BF16Tensor{Shape: shape, Data: data}
}

// BF16TensorFromFloat32 rounds float32 values to bf16 (nearest, ties to even).
func BF16TensorFromFloat32(data []float32, shape ...int) BF16Tensor {
	return BF16Tensor{Shape: shape, Data: Float32sToBF16(data)}
}

// IsSet reports whether the tensor is present (has a shape).
func (t BF16Tensor) IsSet() bool { return t.Shape != nil }

// NumElements is the product of the shape (1 for a scalar shape []int{}).
func (t BF16Tensor) NumElements() int { return numElements(t.Shape) }

// Float32 widens every element to float32.
func (t BF16Tensor) Float32() []float32 { return BF16sToFloat32(t.Data) }

// Proto encodes the tensor as a wire Tensor (DTYPE_BF16, little-endian). It does not check that
// len(Data) matches Shape: the server rejects such a tensor with INVALID_ARGUMENT, naming it.
func (t BF16Tensor) Proto() *pb.Tensor {
	data := make([]byte, 2*len(t.Data))
	for i, v := range t.Data {
		binary.LittleEndian.PutUint16(data[2*i:], v)
	}
	return &pb.Tensor{Dtype: pb.DType_DTYPE_BF16, Shape: shape64(t.Shape), Data: data}
}

// BF16TensorFromProto decodes a DTYPE_BF16 wire tensor.
func BF16TensorFromProto(t *pb.Tensor) (BF16Tensor, error) {
	shape, n, err := checkWire(t, pb.DType_DTYPE_BF16, 2)
	if err != nil {
		return BF16Tensor{}, err
	}
	data := make([]uint16, n)
	for i := range data {
		data[i] = binary.LittleEndian.Uint16(t.Data[2*i:])
	}
	return BF16Tensor{Shape: shape, Data: data}, nil
}

// F32Tensor is a dense row-major float32 tensor (the lse of a response). The zero value (nil
// Shape) means "absent".
type F32Tensor struct {
	Shape []int
	Data  []float32
}

// IsSet reports whether the tensor is present (has a shape).
func (t F32Tensor) IsSet() bool { return t.Shape != nil }

// NumElements is the product of the shape.
func (t F32Tensor) NumElements() int { return numElements(t.Shape) }

// Proto encodes the tensor as a wire Tensor (DTYPE_FP32, little-endian).
func (t F32Tensor) Proto() *pb.Tensor {
	data := make([]byte, 4*len(t.Data))
	for i, v := range t.Data {
		binary.LittleEndian.PutUint32(data[4*i:], math.Float32bits(v))
	}
	return &pb.Tensor{Dtype: pb.DType_DTYPE_FP32, Shape: shape64(t.Shape), Data: data}
}

// F32TensorFromProto decodes a DTYPE_FP32 wire tensor.
func F32TensorFromProto(t *pb.Tensor) (F32Tensor, error) {
	shape, n, err := checkWire(t, pb.DType_DTYPE_FP32, 4)
	if err != nil {
		return F32Tensor{}, err
	}
	data := make([]float32, n)
	for i := range data {
		data[i] = math.Float32frombits(binary.LittleEndian.Uint32(t.Data[4*i:]))
	}
	return F32Tensor{Shape: shape, Data: data}, nil
}

func checkWire(t *pb.Tensor, dtype pb.DType, size int) (shape []int, n int, err error) {
	if t == nil {
		return nil, 0, fmt.Errorf("tensor is missing")
	}
	if t.Dtype != dtype {
		return nil, 0, fmt.Errorf("tensor dtype %v, want %v", t.Dtype, dtype)
	}
	shape = make([]int, len(t.Shape))
	n = 1
	for i, d := range t.Shape {
		if d < 0 || d > math.MaxInt32 {
			return nil, 0, fmt.Errorf("tensor shape %v has a bad dimension", t.Shape)
		}
		shape[i] = int(d)
		n *= int(d)
	}
	if len(t.Data) != n*size {
		return nil, 0, fmt.Errorf("tensor data has %d bytes, shape %v of %v needs %d",
			len(t.Data), t.Shape, dtype, n*size)
	}
	return shape, n, nil
}

func numElements(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}

func shape64(shape []int) []int64 {
	out := make([]int64, len(shape))
	for i, d := range shape {
		out[i] = int64(d)
	}
	return out
}
