// Package reference recomputes attnserve's attention in float64, for tests and for schedulers
// that want to check the server (the contract of docs/design.md "Attention semantics"):
//
//   - row r of sequence b appends the token at position kv_len[b] - q_len[b] + (r - qo_indptr[b]);
//   - bottom-right aligned causal mask: row i sees key j iff j <= i + kv_len - q_len;
//   - natural-exp softmax; lse is the base-2 log-sum-exp of the scaled logits;
//   - a row that sees no key has output 0 and lse -1e30 (attnserve.EmptyRowLSE);
//   - GQA: query head h reads KV head h / (H / H_kv). MLA (absorbed): every head reads the
//     576-wide latent row [ckv, kpe]; logits use all 576 columns, the output is P times ckv.
//
// A client keeps its own copy of the K/V it appended (Mirror, by layer and page id) and
// recomputes every result over the same page table the server got. Inputs should already be
// bf16-rounded (attnserve.RoundToBF16s) so both sides see the same values.
package reference

import (
	"fmt"
	"math"

	"attnserve/client/go/attnserve"
)

// Tolerance of the contract: an element fails only if |x-ref| > ATol AND
// |x-ref| / (|ref| + 1e-8) > RTol.
const (
	ATol = 1e-2
	RTol = 1e-2
)

// Field is one named per-token quantity a Mirror stores, Width values per token (GQA "k" and
// "v" of H_kv * D; MLA "ckv" of 512 and "kpe" of 64).
type Field struct {
	Name  string
	Width int
}

// Mirror is a client-side copy of the tokens written into one pool, per layer and page. Slots
// never written read as NaN, so a reference that uses them shows it.
type Mirror struct {
	numLayers int
	pageSize  int
	fields    []Field
	pages     map[pageKey][][]float32 // per field: [pageSize * width]
}

type pageKey struct{ layer, page int32 }

// NewMirror returns an empty mirror of a pool's geometry.
func NewMirror(numLayers, pageSize int, fields ...Field) *Mirror {
	return &Mirror{numLayers: numLayers, pageSize: pageSize, fields: fields,
		pages: map[pageKey][][]float32{}}
}

// ForPool returns a mirror with the fields of the pool's kind: GQA "k", "v"
// ([H_kv, D] each); MLA "ckv" [512], "kpe" [64].
func ForPool(p attnserve.PoolInfo) (*Mirror, error) {
	switch p.Kind {
	case attnserve.PoolKindGQA:
		w := p.NumKVHeads * p.HeadDim
		return NewMirror(p.NumLayers, p.PageSize, Field{"k", w}, Field{"v", w}), nil
	case attnserve.PoolKindMLA:
		return NewMirror(p.NumLayers, p.PageSize,
			Field{"ckv", attnserve.MLACKVDim}, Field{"kpe", attnserve.MLAKPEDim}), nil
	}
	return nil, fmt.Errorf("reference: unknown pool kind %v", p.Kind)
}

// Append writes one new token per query row of the table (the table after the append, as sent
// with the call). rows maps every field name to [total_q * width] values.
func (m *Mirror) Append(layer int, table attnserve.BatchCSR, rows map[string][]float32) error {
	if err := m.checkLayer(layer); err != nil {
		return err
	}
	if len(rows) != len(m.fields) {
		return fmt.Errorf("reference: append needs fields %v, got %d", m.fields, len(rows))
	}
	totalQ := table.TotalQ()
	for _, f := range m.fields {
		if len(rows[f.Name]) != totalQ*f.Width {
			return fmt.Errorf("reference: field %q has %d values, want %d x %d",
				f.Name, len(rows[f.Name]), totalQ, f.Width)
		}
	}
	kvLens := table.KVLens(m.pageSize)
	for b := 0; b < table.BatchSize(); b++ {
		qBegin, qEnd := int(table.QOIndptr[b]), int(table.QOIndptr[b+1])
		first := kvLens[b] - (qEnd - qBegin)
		if first < 0 {
			return fmt.Errorf("reference: sequence %d: q_len %d > kv_len %d", b, qEnd-qBegin, kvLens[b])
		}
		pages := table.SeqPages(b)
		for r := qBegin; r < qEnd; r++ {
			pos := first + r - qBegin
			stored := m.page(layer, pages[pos/m.pageSize])
			slot := pos % m.pageSize
			for i, f := range m.fields {
				copy(stored[i][slot*f.Width:(slot+1)*f.Width], rows[f.Name][r*f.Width:(r+1)*f.Width])
			}
		}
	}
	return nil
}

// Gather returns the tokens of sequence seq in order, per field [kv_len * width] as float64.
func (m *Mirror) Gather(layer int, table attnserve.BatchCSR, seq int) (map[string][]float64, int, error) {
	if err := m.checkLayer(layer); err != nil {
		return nil, 0, err
	}
	kvLen := table.KVLens(m.pageSize)[seq]
	pages := table.SeqPages(seq)
	out := make(map[string][]float64, len(m.fields))
	for i, f := range m.fields {
		vals := make([]float64, kvLen*f.Width)
		for pos := 0; pos < kvLen; pos++ {
			stored := m.page(layer, pages[pos/m.pageSize])[i]
			slot := pos % m.pageSize
			for c := 0; c < f.Width; c++ {
				vals[pos*f.Width+c] = float64(stored[slot*f.Width+c])
			}
		}
		out[f.Name] = vals
	}
	return out, kvLen, nil
}

func (m *Mirror) page(layer int, page int32) [][]float32 {
	key := pageKey{int32(layer), page}
	p, ok := m.pages[key]
	if !ok {
		p = make([][]float32, len(m.fields))
		for i, f := range m.fields {
			p[i] = make([]float32, m.pageSize*f.Width)
			for j := range p[i] {
				p[i][j] = float32(math.NaN())
			}
		}
		m.pages[key] = p
	}
	return p
}

func (m *Mirror) checkLayer(layer int) error {
	if layer < 0 || layer >= m.numLayers {
		return fmt.Errorf("reference: layer %d out of range [0, %d)", layer, m.numLayers)
	}
	return nil
}

// Attend is causal attention of one sequence in float64: q [qLen, H, Dk], keys
// [kvLen, Hkv, Dk], values [kvLen, Hkv, Dv], all row-major; query head h reads KV head
// h / (H / Hkv). It returns the output [qLen, H, Dv] and the base-2 lse [qLen, H].
func Attend(q []float64, qLen, numHeads, dk int, keys, values []float64, kvLen, numKVHeads, dv int,
	smScale float64) (out, lse []float64) {
	group := numHeads / numKVHeads
	out = make([]float64, qLen*numHeads*dv)
	lse = make([]float64, qLen*numHeads)
	logits := make([]float64, kvLen)
	for i := 0; i < qLen; i++ {
		visible := i + kvLen - qLen + 1 // keys 0 .. visible-1
		if visible > kvLen {
			visible = kvLen
		}
		for h := 0; h < numHeads; h++ {
			row := i*numHeads + h
			if visible <= 0 {
				lse[row] = float64(attnserve.EmptyRowLSE)
				continue
			}
			kvh := h / group
			qv := q[row*dk : (row+1)*dk]
			maxLogit := math.Inf(-1)
			for j := 0; j < visible; j++ {
				kv := keys[(j*numKVHeads+kvh)*dk : (j*numKVHeads+kvh+1)*dk]
				s := 0.0
				for c := range qv {
					s += qv[c] * kv[c]
				}
				logits[j] = smScale * s
				maxLogit = math.Max(maxLogit, logits[j])
			}
			o := out[row*dv : (row+1)*dv]
			sum := 0.0
			for j := 0; j < visible; j++ {
				p := math.Exp(logits[j] - maxLogit)
				sum += p
				vv := values[(j*numKVHeads+kvh)*dv : (j*numKVHeads+kvh+1)*dv]
				for c := range o {
					o[c] += p * vv[c]
				}
			}
			for c := range o {
				o[c] /= sum
			}
			lse[row] = (maxLogit + math.Log(sum)) / math.Ln2
		}
	}
	return out, lse
}

// GQA computes a GQA call: q [total_q, H, D] (as sent, bf16-rounded) over the mirror's tokens
// for the table. smScale 0 means the server's default 1/sqrt(D). Returns output [total_q, H, D]
// and lse [total_q, H].
func GQA(m *Mirror, layer int, table attnserve.BatchCSR, q []float32, numHeads, headDim int,
	smScale float64) (out, lse []float64, err error) {
	if smScale == 0 {
		smScale = 1 / math.Sqrt(float64(headDim))
	}
	numKVHeads := m.fields[0].Width / headDim
	return perSequence(table, numHeads, headDim, func(b, qBegin, qEnd int) ([]float64, []float64, error) {
		kv, kvLen, err := m.Gather(layer, table, b)
		if err != nil {
			return nil, nil, err
		}
		qb := widen(q[qBegin*numHeads*headDim : qEnd*numHeads*headDim])
		o, l := Attend(qb, qEnd-qBegin, numHeads, headDim, kv["k"], kv["v"], kvLen, numKVHeads,
			headDim, smScale)
		return o, l, nil
	})
}

// MLA computes an MLA call: qNope [total_q, H, 512], qPE [total_q, H, 64]. Returns output
// [total_q, H, 512] and lse [total_q, H].
func MLA(m *Mirror, layer int, table attnserve.BatchCSR, qNope, qPE []float32, numHeads int,
	smScale float64) (out, lse []float64, err error) {
	const ckv, kpe = attnserve.MLACKVDim, attnserve.MLAKPEDim
	const dk = ckv + kpe
	return perSequence(table, numHeads, ckv, func(b, qBegin, qEnd int) ([]float64, []float64, error) {
		kv, kvLen, err := m.Gather(layer, table, b)
		if err != nil {
			return nil, nil, err
		}
		rows := (qEnd - qBegin) * numHeads
		q := make([]float64, rows*dk)
		for r := 0; r < rows; r++ {
			g := qBegin*numHeads + r
			for c := 0; c < ckv; c++ {
				q[r*dk+c] = float64(qNope[g*ckv+c])
			}
			for c := 0; c < kpe; c++ {
				q[r*dk+ckv+c] = float64(qPE[g*kpe+c])
			}
		}
		keys := make([]float64, kvLen*dk)
		for j := 0; j < kvLen; j++ {
			copy(keys[j*dk:j*dk+ckv], kv["ckv"][j*ckv:(j+1)*ckv])
			copy(keys[j*dk+ckv:(j+1)*dk], kv["kpe"][j*kpe:(j+1)*kpe])
		}
		o, l := Attend(q, qEnd-qBegin, numHeads, dk, keys, kv["ckv"], kvLen, 1, ckv, smScale)
		return o, l, nil
	})
}

func perSequence(table attnserve.BatchCSR, numHeads, outDim int,
	one func(b, qBegin, qEnd int) ([]float64, []float64, error)) (out, lse []float64, err error) {
	totalQ := table.TotalQ()
	out = make([]float64, totalQ*numHeads*outDim)
	lse = make([]float64, totalQ*numHeads)
	for b := 0; b < table.BatchSize(); b++ {
		qBegin, qEnd := int(table.QOIndptr[b]), int(table.QOIndptr[b+1])
		o, l, err := one(b, qBegin, qEnd)
		if err != nil {
			return nil, nil, err
		}
		copy(out[qBegin*numHeads*outDim:], o)
		copy(lse[qBegin*numHeads:], l)
	}
	return out, lse, nil
}

func widen(x []float32) []float64 {
	out := make([]float64, len(x))
	for i, v := range x {
		out[i] = float64(v)
	}
	return out
}

// CloseResult is the outcome of CheckClose.
type CloseResult struct {
	MaxAbsErr   float64 // NaN or +Inf when x holds one
	NumFailed   int
	NumElements int
	FirstFailed int // index of the first failing element, -1 if none
}

// OK reports whether every element passed.
func (r CloseResult) OK() bool { return r.NumFailed == 0 }

func (r CloseResult) String() string {
	return fmt.Sprintf("%d/%d elements out of tolerance, max |err| %.3g", r.NumFailed, r.NumElements,
		r.MaxAbsErr)
}

// CheckClose applies the contract's tolerance (ATol, RTol) element by element. A NaN or an
// infinity in x always fails. x and ref must have the same length (else every element fails).
func CheckClose(x []float32, ref []float64) CloseResult {
	return CheckCloseTol(x, ref, ATol, RTol)
}

// CheckCloseTol is CheckClose with other tolerances.
func CheckCloseTol(x []float32, ref []float64, atol, rtol float64) CloseResult {
	r := CloseResult{NumElements: len(ref), FirstFailed: -1}
	if len(x) != len(ref) {
		r.NumFailed, r.MaxAbsErr, r.FirstFailed = len(ref), math.Inf(1), 0
		return r
	}
	for i := range x {
		err := math.Abs(float64(x[i]) - ref[i])
		if err > r.MaxAbsErr || math.IsNaN(err) {
			if !math.IsNaN(r.MaxAbsErr) {
				r.MaxAbsErr = err
			}
		}
		if !(err <= atol || err/(math.Abs(ref[i])+1e-8) <= rtol) {
			r.NumFailed++
			if r.FirstFailed < 0 {
				r.FirstFailed = i
			}
		}
	}
	return r
}
