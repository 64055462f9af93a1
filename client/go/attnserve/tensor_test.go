package attnserve

import (
	"math"
	"reflect"
	"strings"
	"testing"

	pb "attnserve/client/go/gen/attnservev1"
)

func TestBF16TensorWire(t *testing.T) {
	x := BF16TensorFromFloat32([]float32{1, -2, 0.5, 3, 4, 5}, 2, 3)
	w := x.Proto()
	if w.Dtype != pb.DType_DTYPE_BF16 || !reflect.DeepEqual(w.Shape, []int64{2, 3}) {
		t.Fatalf("wire = %v %v", w.Dtype, w.Shape)
	}
	// Little-endian: 1.0 is 0x3F80.
	if w.Data[0] != 0x80 || w.Data[1] != 0x3F {
		t.Fatalf("first element bytes %x", w.Data[:2])
	}
	back, err := BF16TensorFromProto(w)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, x) || back.NumElements() != 6 {
		t.Fatalf("round trip %v != %v", back, x)
	}
	if f := back.Float32(); f[1] != -2 {
		t.Fatalf("Float32 = %v", f)
	}
}

func TestF32TensorWire(t *testing.T) {
	x := F32Tensor{Shape: []int{2}, Data: []float32{-1e30, float32(math.Inf(1))}}
	back, err := F32TensorFromProto(x.Proto())
	if err != nil || !reflect.DeepEqual(back, x) {
		t.Fatalf("round trip %v, %v", back, err)
	}
}

func TestTensorFromProtoRejectsBadTensors(t *testing.T) {
	good := BF16TensorFromFloat32([]float32{1, 2}, 2).Proto()
	cases := map[string]*pb.Tensor{
		"missing":   nil,
		"dtype":     {Dtype: pb.DType_DTYPE_FP32, Shape: good.Shape, Data: good.Data},
		"too short": {Dtype: good.Dtype, Shape: good.Shape, Data: good.Data[:3]},
		"negative":  {Dtype: good.Dtype, Shape: []int64{-2}, Data: good.Data},
	}
	for name, w := range cases {
		if _, err := BF16TensorFromProto(w); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	_, err := BF16TensorFromProto(&pb.Tensor{Dtype: pb.DType_DTYPE_BF16, Shape: []int64{3}, Data: good.Data})
	if err == nil || !strings.Contains(err.Error(), "needs 6") {
		t.Errorf("size mismatch error = %v", err)
	}
}

func TestAttentionRequestProto(t *testing.T) {
	q := BF16TensorFromFloat32(make([]float32, 8), 1, 2, 4)
	req := &AttentionRequest{
		Pool: "p", Layer: 3, Q: q, KNew: q, VNew: q,
		Table:   BatchCSR{QOIndptr: []int32{0, 1}, KVIndptr: []int32{0, 1}, KVIndices: []int32{7}, KVLastPageLen: []int32{1}},
		SMScale: SMScale(0.5), ReturnLSE: true,
	}
	p := req.PrefillProto()
	if p.Pool != "p" || p.Layer != 3 || p.Q == nil || p.KNew == nil || p.QPe != nil || p.CkvNew != nil ||
		p.GetSmScale() != 0.5 || !p.ReturnLse || !reflect.DeepEqual(p.QoIndptr, []int32{0, 1}) ||
		!reflect.DeepEqual(p.KvIndices, []int32{7}) {
		t.Fatalf("prefill proto %v", p)
	}
	d := req.DecodeProto()
	if d.Layer != 3 || d.Q == nil || !reflect.DeepEqual(d.KvLastPageLen, []int32{1}) || d.SmScale == nil {
		t.Fatalf("decode proto %v", d)
	}
	req.SMScale = nil
	if req.PrefillProto().SmScale != nil {
		t.Fatal("unset sm_scale was sent")
	}
}
