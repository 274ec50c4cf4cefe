// mingru_fwd_s1: 8 values, 6 inputs, 3 outputs
//   a[0] in  v6: [H] = matvec v2, v0
//   a[1] in  v3: [H] = param bias_z
//   a[2] in  v9: [H] = matvec v4, v0
//   a[3] in  v5: [H] = param bias_h
//   a[4] in  v11: f32 = const 1
//   a[5] in  v1: [H] = state h
//   a[6] out v8: [H] = sigmoid v7
//   a[7] out v10: [H] = add v9, v5
//   a[8] out v16: [H] = add v14, v15
// Lane form: one thread per (sequence, unit), 4 units, rows in time order, no barriers.
extern "C" __global__ void mingru_fwd_s1(float* const* __restrict__ args, const int* __restrict__ seq_start, const int* __restrict__ seq_rows, int sequences, float* __restrict__ scratch) {
    const int chunks = (4 + (int)blockDim.x - 1) / (int)blockDim.x;
    for (int item = blockIdx.x; item < sequences * chunks; item += gridDim.x) {
        const int seq = item / chunks;
        const int j = (item - seq * chunks) * (int)blockDim.x + (int)threadIdx.x;
        if (j >= 4) continue;
        const int first = seq_start[seq], end = first + seq_rows[seq];
        // v1: [H] = state h: read at the first row, then carried from a[8] of the row before
        float c5 = first < end ? args[(size_t)first * 9 + 5][j] : 0.0f;
        for (int row = first; row < end; ++row) {
            float* const* const a = args + (size_t)row * 9;
            // v7: [H] = add v6, v3
            // v8: [H] = sigmoid v7
            // v10: [H] = add v9, v5
            // v13: [H] = sub v12, v8
            // v14: [H] = mul v13, v1
            // v15: [H] = mul v8, v10
            // v16: [H] = add v14, v15
            const float t7 = (a[0][j] + a[1][j]);
            const float t8 = cellc_sigmoid(t7);
            a[6][j] = t8;
            const float t10 = (a[2][j] + a[3][j]);
            a[7][j] = t10;
            const float t13 = (1e0f - t8);
            const float t14 = (t13 * c5);
            const float t15 = (t8 * t10);
            const float t16 = (t14 + t15);
            a[8][j] = t16;
            c5 = t16;
        }
    }
}

// mingru_bwd_s0: 9 values, 6 inputs, 3 outputs
//   a[0] in  v12: [H] = broadcast v11
//   a[1] in  v8: [H] = sigmoid v7
//   a[2] in  v17: [H] = seed d_output
//   a[3] in  v18: [H] = seed d_h'
//   a[4] in  v10: [H] = add v9, v5
//   a[5] in  v1: [H] = state h
//   a[6] out v21: [H] = mul v19, v8
//   a[7] out v23: [H] = mul v19, v13
//   a[8] out v33: [H] = mul v28, v32
// Lane form: one thread per (sequence, unit), 4 units, rows in time order, no barriers.
extern "C" __global__ void mingru_bwd_s0(float* const* __restrict__ args, const int* __restrict__ seq_start, const int* __restrict__ seq_rows, int sequences, float* __restrict__ scratch) {
    const int chunks = (4 + (int)blockDim.x - 1) / (int)blockDim.x;
    for (int item = blockIdx.x; item < sequences * chunks; item += gridDim.x) {
        const int seq = item / chunks;
        const int j = (item - seq * chunks) * (int)blockDim.x + (int)threadIdx.x;
        if (j >= 4) continue;
        const int first = seq_start[seq], end = first + seq_rows[seq];
        // v18: [H] = seed d_h': read at the first row, then carried from a[7] of the row before
        float c3 = first < end ? args[(size_t)first * 9 + 3][j] : 0.0f;
        for (int row = first; row < end; ++row) {
            float* const* const a = args + (size_t)row * 9;
            // v13: [H] = sub v12, v8
            // v19: [H] = add v17, v18
            // v20: [H] = mul v19, v10
            // v21: [H] = mul v19, v8
            // v22: [H] = mul v19, v1
            // v23: [H] = mul v19, v13
            // v28: [H] = sub v20, v22
            // v32: [H] = mul v8, v13
            // v33: [H] = mul v28, v32
            const float t13 = (1e0f - a[1][j]);
            const float t19 = (a[2][j] + c3);
            const float t20 = (t19 * a[4][j]);
            const float t21 = (t19 * a[1][j]);
            a[6][j] = t21;
            const float t22 = (t19 * a[5][j]);
            const float t23 = (t19 * t13);
            a[7][j] = t23;
            const float t28 = (t20 - t22);
            const float t32 = (a[1][j] * t13);
            const float t33 = (t28 * t32);
            a[8][j] = t33;
            c3 = t23;
        }
    }
}

// mingru_bwd_s5: 1 values, 2 inputs, 1 outputs
//   a[0] in  v27: [I] = matvect v4, v21
//   a[1] in  v35: [I] = matvect v2, v33
//   a[2] out v36: [I] = add v27, v35
// Lane form: one thread per (row, unit), 3 units; thread j computes element p * 3 + j of every vector.
__device__ __forceinline__ void mingru_bwd_s5_row(float* const* __restrict__ a, int j) {
    // v36: [I] = add v27, v35
    const float t36 = (a[0][j] + a[1][j]);
    a[2][j] = t36;
}
extern "C" __global__ void mingru_bwd_s5(float* const* __restrict__ args, int rows, float* __restrict__ scratch) {
    const int chunks = (3 + (int)blockDim.x - 1) / (int)blockDim.x;
    for (int item = blockIdx.x; item < rows * chunks; item += gridDim.x) {
        const int row = item / chunks;
        const int j = (item - row * chunks) * (int)blockDim.x + (int)threadIdx.x;
        if (j >= 3) continue;
        mingru_bwd_s5_row(args + (size_t)row * 3, j);
    }
}

