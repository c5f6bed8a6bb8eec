// tutel-jax native CPU kernel: the routed gated-linear-unit experts of one MoE layer, as an XLA FFI custom call.
//
//   y[s] = sum_k dec[k, s] * expert_{ids[k, s]}(enc[k, s] * x[s])
//   expert_e(r) = W2_e . glu(W1_e . r + b1_e) + b2_e
//   glu 0 (SwiGLU):  h = [gate | up] (halves),  silu(gate) * up
//   glu 1 (GPT-OSS): h = interleaved (gate = even, up = odd), gate = min(gate, limit),
//                    up = clip(up, -limit, limit), (up + 1) * gate * sigmoid(alpha * gate)
//
// x [S, M] f32, ids [K, S] s32, enc / dec [K, S] f32 -> y [S, Mo] f32. W1 is one weight of 2I outputs, or (with
// `split_up`) a gate and an up weight of I outputs each; W2 has Mo outputs over I inputs; each weight [E, out,
// in] rows, float or packed (see weights.h); b1 [E, 2I] and b2 [E, Mo] float32 or bfloat16 (read as
// they are: only the used experts' rows), or empty.
// With `int8_activations`, an FP4 weight's (MXFP4, NVFP4) activation rows are quantized to int8 per block of 32
// (q8_rows.h: integer dot products, llama.cpp's Q8_0 activations), however many rows an expert received.
// An assignment whose expert id is outside [0, E) (another device's expert) or whose enc or dec is 0 (dropped)
// costs nothing. Only the experts that received tokens are read, each weight byte once per call (decode: up to
// 8 rows per register pass; more rows re-read a 64-row block from cache).
// Three phases over XLA's intra-op thread pool: (1) W1 blocks of every used expert, (2) per expert the bias and
// GLU, (3) W2 by blocks of output columns over all used experts, each block summing into its own columns of y
// (no per-thread buffers; the same sums in the same order whatever the thread count).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "weights.h"

namespace ffi = xla::ffi;

namespace {

struct Assignment {
  int64_t token;
  float enc, dec;
};

struct UsedExpert {
  int64_t e;
  std::vector<Assignment> rows;
  int64_t x_offset = 0, h_offset = 0, a_offset = 0;  // into the shared buffers
  int64_t xq_offset = -1, aq_offset = -1;             // its int8 rows (q8_rows.h), or -1: float32 activations
};

struct Glu {
  int kind;
  float alpha, limit;
  int64_t hidden;

  // a [I] from h [2I], a register of outputs at a time (sigmoids by `sigmoid_lanes`), the last ones one at a time
  void apply(const float* h, float* a) const {
    const int64_t I = hidden, full = I / tj::kNativeLanes * tj::kNativeLanes;
    for (int64_t i = 0; i < full; i += tj::kNativeLanes) tj::store(a + i, lanes(h, i));
    if (full < I) {
      alignas(64) float part[2 * tj::kNativeLanes] = {}, out[tj::kNativeLanes];
      if (kind == 0) {
        std::copy(h + full, h + I, part);
        std::copy(h + I + full, h + 2 * I, part + tj::kNativeLanes);
      } else {
        std::copy(h + 2 * full, h + 2 * I, part);
      }
      tj::store(out, kind == 0 ? swiglu(tj::load(part), tj::load(part + tj::kNativeLanes)) : gpt_oss(part));
      std::copy(out, out + (I - full), a + full);
    }
  }

 private:
  tj::Native lanes(const float* h, int64_t i) const {
    return kind == 0 ? swiglu(tj::load(h + i), tj::load(h + hidden + i)) : gpt_oss(h + 2 * i);
  }

  // silu(gate) * up
  static tj::Native swiglu(tj::Native gate, tj::Native up) { return gate * tj::sigmoid_lanes(gate) * up; }

  // interleaved pairs at p: gate = min(even, limit), up = clip(odd, -limit, limit),
  // (up + 1) * gate * sigmoid(alpha * gate) (NaN kept as std::min / std::max keep it)
  tj::Native gpt_oss(const float* p) const {
    tj::Native gate, up;
    for (int l = 0; l < tj::kNativeLanes; ++l) {
      gate[l] = p[2 * l];
      up[l] = p[2 * l + 1];
    }
    const tj::Native lim = tj::splat(limit), neg = tj::splat(-limit);
    gate = (tj::Native)tj::select((tj::UNative)(lim < gate), (tj::UNative)lim, (tj::UNative)gate);
    up = (tj::Native)tj::select((tj::UNative)(up < neg), (tj::UNative)neg, (tj::UNative)up);
    up = (tj::Native)tj::select((tj::UNative)(lim < up), (tj::UNative)lim, (tj::UNative)up);
    return (up + 1.0f) * (gate * tj::sigmoid_lanes(gate * alpha));
  }
};

ffi::Error MoeExpertsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                          ffi::Buffer<ffi::F32> enc, ffi::Buffer<ffi::F32> dec, ffi::AnyBuffer g_data,
                          ffi::AnyBuffer g_scale, ffi::AnyBuffer g_global, ffi::AnyBuffer u_data,
                          ffi::AnyBuffer u_scale, ffi::AnyBuffer u_global, ffi::AnyBuffer d_data,
                          ffi::AnyBuffer d_scale, ffi::AnyBuffer d_global, ffi::AnyBuffer b1,
                          ffi::AnyBuffer b2, ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t w1_format,
                          int64_t w2_format, bool split_up, int64_t glu, float alpha, float limit,
                          bool int8_activations, int64_t max_workers) {
  auto xd = x.dimensions(), idd = ids.dimensions();
  if (xd.size() != 2 || idd.size() != 2 || idd[1] != xd[0] || !(enc.dimensions() == idd) ||
      !(dec.dimensions() == idd))
    return ffi::Error::InvalidArgument("moe_experts: expected x [S, M] and ids, enc, dec [K, S]");
  const int64_t S = xd[0], M = xd[1], Kk = idd[0];
  std::vector<tj::Weight> w1(split_up ? 2 : 1);
  tj::Weight w2;
  std::string err = tj::parse_weight(split_up ? "gate weight" : "gate_up weight", w1_format, g_data, g_scale,
                                     g_global, &w1[0]);
  if (err.empty() && split_up) err = tj::parse_weight("up weight", w1_format, u_data, u_scale, u_global, &w1[1]);
  if (err.empty()) err = tj::parse_weight("down weight", w2_format, d_data, d_scale, d_global, &w2);
  if (!err.empty()) return ffi::Error::InvalidArgument("moe_experts: " + err);
  const int64_t E = w2.E, I = w2.K, Mo = w2.N, H = split_up ? 2 * w1[0].N : w1[0].N;
  for (const auto& w : w1)
    if (w.E != E || w.K != M) return ffi::Error::InvalidArgument("moe_experts: W1 must be [E, M] -> outputs");
  if (H != 2 * I || (split_up && w1[1].N != w1[0].N))
    return ffi::Error::InvalidArgument("moe_experts: W1 must have 2I outputs for W2's I inputs");
  const tj::Bias bias1(b1), bias2(b2);
  if ((bias1.present() && tj::product(b1.dimensions()) != E * H) ||
      (bias2.present() && tj::product(b2.dimensions()) != E * Mo) || !bias1.valid() || !bias2.valid())
    return ffi::Error::InvalidArgument(
        "moe_experts: biases must be float32 or bfloat16 [E, 2I] and [E, Mo] (or empty)");
  if (y->dimensions()[0] != S || y->dimensions()[1] != Mo)
    return ffi::Error::InvalidArgument("moe_experts: output must be [S, Mo]");
  const Glu glu_fn{int(glu), alpha, limit, I};

  // Group the kept assignments by expert (token order within an expert).
  std::vector<UsedExpert> used;
  std::vector<int64_t> slot(E, -1);
  const int32_t* id = ids.typed_data();
  const float* en = enc.typed_data();
  const float* de = dec.typed_data();
  for (int64_t s = 0; s < S; ++s)
    for (int64_t k = 0; k < Kk; ++k) {
      const int64_t a = k * S + s, e = id[a];
      if (e < 0 || e >= E || en[a] == 0.0f || de[a] == 0.0f) continue;
      if (slot[e] < 0) {
        slot[e] = int64_t(used.size());
        used.push_back({e, {}});
      }
      used[slot[e]].rows.push_back({s, en[a], de[a]});
    }
  int64_t total = 0, xq_bytes = 0, aq_bytes = 0;
  const int64_t block1 = tj::fp4_block(w1[0].fmt), block2 = tj::fp4_block(w2.fmt);
  const int64_t ldq1 = tj::q8_row_bytes(M, block1), ldq2 = tj::q8_row_bytes(I, block2);
  for (auto& u : used) {
    const int64_t rows = int64_t(u.rows.size());
    u.x_offset = total * M;
    u.h_offset = total * H;
    u.a_offset = total * I;
    total += rows;
    if (int8_activations && w1[0].takes_q8()) {
      u.xq_offset = xq_bytes;
      xq_bytes += rows * ldq1;
    }
    if (int8_activations && w2.takes_q8()) {
      u.aq_offset = aq_bytes;
      aq_bytes += rows * ldq2;
    }
  }
  float* out = y->typed_data();
  std::memset(out, 0, sizeof(float) * S * Mo);
  if (total == 0) return ffi::Error::Success();

  std::vector<float> xin(total * M), h(total * H), a(total * I);
  std::vector<uint8_t> xq(xq_bytes), aq(aq_bytes);
  const float* xs = x.typed_data();
  {
    // Each expert's input rows (enc * x[token]) as W1 reads them: int8 (the float ones are then not read) or
    // arranged float32. A row equal to an earlier one (the same token and enc in the same form: a decode
    // token's k experts) is copied from it; the distinct ones are prepared over the pool.
    struct Row {
      void* dst;
      int64_t token;
      float enc;
      bool q8, lanes;    // int8, in the block-lane form (q8_rows.h: by its expert's row count)
      int64_t same_as;  // -1, or an earlier Row this one copies
    };
    std::vector<Row> rows;
    for (const auto& u : used) {
      const bool q8 = u.xq_offset >= 0, lanes = q8 && tj::q8_block_lanes(w1[0].fmt, int64_t(u.rows.size()));
      for (size_t r = 0; r < u.rows.size(); ++r) {
        void* dst = q8 ? static_cast<void*>(xq.data() + u.xq_offset + int64_t(r) * ldq1)
                       : static_cast<void*>(xin.data() + u.x_offset + int64_t(r) * M);
        rows.push_back({dst, u.rows[r].token, u.rows[r].enc, q8, lanes, -1});
      }
    }
    std::vector<int64_t> distinct, first(S, -1);  // first: each token's first row
    for (int64_t i = 0; i < int64_t(rows.size()); ++i) {
      int64_t& f = first[rows[i].token];
      if (f >= 0 && rows[f].enc == rows[i].enc && rows[f].q8 == rows[i].q8 && rows[f].lanes == rows[i].lanes) {
        rows[i].same_as = f;
        continue;
      }
      if (f < 0) f = i;
      distinct.push_back(i);
    }
    tj::run_items(pool, int64_t(distinct.size()), max_workers, [&](int64_t i) {
      const Row& row = rows[distinct[i]];
      std::vector<float> scaled(M);
      const float* src = xs + row.token * M;
      for (int64_t m = 0; m < M; ++m) scaled[m] = row.enc * src[m];
      if (row.q8)
        tj::quantize_q8(scaled.data(), M, block1, row.lanes, static_cast<uint8_t*>(row.dst));
      else
        tj::arrange(w1[0].fmt, scaled.data(), M, static_cast<float*>(row.dst));
    });
    for (const Row& row : rows)
      if (row.same_as >= 0)
        std::memcpy(row.dst, rows[row.same_as].dst, row.q8 ? size_t(ldq1) : sizeof(float) * M);
  }
  auto quantized = [](std::vector<uint8_t>& buf, int64_t offset) {
    return offset < 0 ? nullptr : buf.data() + offset;
  };

  // (1) W1: items (expert, part, block of outputs)
  struct Item {
    int64_t j, part, n0, n1;
  };
  std::vector<Item> items;
  for (int64_t j = 0; j < int64_t(used.size()); ++j)
    for (int64_t p = 0; p < int64_t(w1.size()); ++p)
      for (int64_t n0 = 0; n0 < w1[p].N; n0 += tj::Weight::kItemRows)
        items.push_back({j, p, n0, std::min(w1[p].N, n0 + tj::Weight::kItemRows)});
  tj::run_items(pool, int64_t(items.size()), max_workers, [&](int64_t i) {
    const Item& it = items[i];
    const UsedExpert& u = used[it.j];
    const int64_t col = it.part * w1[0].N + it.n0;
    w1[it.part].rows(u.e, xin.data() + u.x_offset, int(u.rows.size()), M, it.n0, it.n1, h.data() + u.h_offset + col, H,
                     quantized(xq, u.xq_offset), ldq1);
  });

  // (2) bias and GLU per used expert, the activations laid out for W2
  tj::run_items(pool, int64_t(used.size()), max_workers, [&](int64_t j) {
    const UsedExpert& u = used[j];
    std::vector<float> act(I);
    const bool lanes = tj::q8_block_lanes(w2.fmt, int64_t(u.rows.size()));
    for (size_t r = 0; r < u.rows.size(); ++r) {
      float* hr = h.data() + u.h_offset + int64_t(r) * H;
      if (bias1.present()) bias1.add_to(hr, u.e * H, H);
      glu_fn.apply(hr, act.data());
      if (u.aq_offset >= 0)
        tj::quantize_q8(act.data(), I, block2, lanes, aq.data() + u.aq_offset + int64_t(r) * ldq2);
      else
        tj::arrange(w2.fmt, act.data(), I, a.data() + u.a_offset + int64_t(r) * I);
    }
  });

  // (3) W2 by output blocks over all used experts
  const int64_t width = tj::Weight::kItemRows;
  tj::run_items(pool, (Mo + width - 1) / width, max_workers, [&](int64_t b) {
    const int64_t n0 = b * width, n1 = std::min(Mo, n0 + width), bw = n1 - n0;
    std::vector<float> tmp, row(bw);
    for (const auto& u : used) {
      const int64_t rows = int64_t(u.rows.size());
      tmp.resize(rows * bw);
      w2.rows(u.e, a.data() + u.a_offset, int(rows), I, n0, n1, tmp.data(), bw, quantized(aq, u.aq_offset), ldq2);
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = out + u.rows[r].token * Mo + n0;
        const float* src = tmp.data() + r * bw;
        const float d = u.rows[r].dec;
        if (bias2.present()) {
          std::copy(src, src + bw, row.begin());
          bias2.add_to(row.data(), u.e * Mo + n0, bw);
          src = row.data();
        }
        for (int64_t c = 0; c < bw; ++c) dst[c] += d * src[c];
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TutelJaxMoeExperts, MoeExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::S32>>()   // ids
                                  .Arg<ffi::Buffer<ffi::F32>>()   // enc
                                  .Arg<ffi::Buffer<ffi::F32>>()   // dec
                                  .Arg<ffi::AnyBuffer>()          // gate (or gate_up): data, scale, global
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()          // up (split_up): data, scale, global
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()          // down: data, scale, global
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()          // b1
                                  .Arg<ffi::AnyBuffer>()          // b2
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
                                  .Attr<int64_t>("w1_format")
                                  .Attr<int64_t>("w2_format")
                                  .Attr<bool>("split_up")
                                  .Attr<int64_t>("glu")
                                  .Attr<float>("alpha")
                                  .Attr<float>("limit")
                                  .Attr<bool>("int8_activations")
                                  .Attr<int64_t>("max_workers"));
