// sru_fwd_s1: 20 values, 8 inputs, 5 outputs
//   a[0] in  v7: [3*H] = matvec v2, v0
//   a[1] in  v3: [H] = param v_f
//   a[2] in  v1: [H] = state c
//   a[3] in  v5: [H] = param bias_f
//   a[4] in  v4: [H] = param v_r
//   a[5] in  v6: [H] = param bias_r
//   a[6] in  v20: f32 = const 1
//   a[7] in  v0: [H] = input x
//   a[8] out v8: [H] = slice v7, offset 0
//   a[9] out v14: [H] = sigmoid v13
//   a[10] out v18: [H] = sigmoid v17
//   a[11] out v24: [H] = add v19, v23
//   a[12] out v29: [H] = add v25, v28
// Lane form: one thread per (sequence, unit), 4 units, rows in time order, no barriers.
extern "C" __global__ void sru_fwd_s1(float* const* __restrict__ args, const int* __restrict__ seq_start, const int* __restrict__ seq_rows, int sequences, float* __restrict__ scratch) {
    const int chunks = (4 + (int)blockDim.x - 1) / (int)blockDim.x;
    for (int item = blockIdx.x; item < sequences * chunks; item += gridDim.x) {
        const int seq = item / chunks;
        const int j = (item - seq * chunks) * (int)blockDim.x + (int)threadIdx.x;
        if (j >= 4) continue;
        const int first = seq_start[seq], end = first + seq_rows[seq];
        // v1: [H] = state c: read at the first row, then carried from a[11] of the row before
        float c2 = first < end ? args[(size_t)first * 13 + 2][j] : 0.0f;
        for (int row = first; row < end; ++row) {
            float* const* const a = args + (size_t)row * 13;
            // v8: [H] = slice v7, offset 0
            // v9: [H] = slice v7, offset H
            // v10: [H] = slice v7, offset 2*H
            // v11: [H] = mul v3, v1
            // v12: [H] = add v9, v11
            // v13: [H] = add v12, v5
            // v14: [H] = sigmoid v13
            // v15: [H] = mul v4, v1
            // v16: [H] = add v10, v15
            // v17: [H] = add v16, v6
            // v18: [H] = sigmoid v17
            // v19: [H] = mul v14, v1
            // v22: [H] = sub v21, v14
            // v23: [H] = mul v22, v8
            // v24: [H] = add v19, v23
            // v25: [H] = mul v18, v24
            // v27: [H] = sub v21, v18
            // v28: [H] = mul v27, v0
            // v29: [H] = add v25, v28
            const float t11 = (a[1][j] * c2);
            const float t12 = ((a[0] + 4)[j] + t11);
            const float t13 = (t12 + a[3][j]);
            const float t14 = cellc_sigmoid(t13);
            a[9][j] = t14;
            const float t15 = (a[4][j] * c2);
            const float t16 = ((a[0] + 8)[j] + t15);
            const float t17 = (t16 + a[5][j]);
            const float t18 = cellc_sigmoid(t17);
            a[10][j] = t18;
            const float t19 = (t14 * c2);
            const float t22 = (1e0f - t14);
            const float t23 = (t22 * (a[0] + 0)[j]);
            const float t24 = (t19 + t23);
            a[11][j] = t24;
            const float t25 = (t18 * t24);
            const float t27 = (1e0f - t18);
            const float t28 = (t27 * a[7][j]);
            const float t29 = (t25 + t28);
            a[12][j] = t29;
            // output v8
            a[8][j] = (a[0] + 0)[j];
            c2 = t24;
        }
    }
}

// sru_bwd_s0: 26 values, 11 inputs, 8 outputs
//   a[0] in  v21: [H] = broadcast v20
//   a[1] in  v14: [H] = sigmoid v13
//   a[2] in  v18: [H] = sigmoid v17
//   a[3] in  v26: [H] = seed d_output
//   a[4] in  v0: [H] = input x
//   a[5] in  v24: [H] = add v19, v23
//   a[6] in  v30: [H] = seed d_c'
//   a[7] in  v8: [H] = slice v7, offset 0
//   a[8] in  v1: [H] = state c
//   a[9] in  v4: [H] = param v_r
//   a[10] in  v3: [H] = param v_f
//   a[11] out v22: [H] = sub v21, v14
//   a[12] out v32: [H] = mul v26, v27
//   a[13] out v49: [H] = mul v44, v48
//   a[14] out v50: [H] = mul v49, v1
//   a[15] out v57: [H] = mul v52, v56
//   a[16] out v58: [H] = mul v57, v1
//   a[17] out v63: [3*H] = concat v38, v57, v49
//   a[18] out v67: [H] = add v66, v59
// Lane form: one thread per (sequence, unit), 4 units, rows in time order, no barriers.
extern "C" __global__ void sru_bwd_s0(float* const* __restrict__ args, const int* __restrict__ seq_start, const int* __restrict__ seq_rows, int sequences, float* __restrict__ scratch) {
    const int chunks = (4 + (int)blockDim.x - 1) / (int)blockDim.x;
    for (int item = blockIdx.x; item < sequences * chunks; item += gridDim.x) {
        const int seq = item / chunks;
        const int j = (item - seq * chunks) * (int)blockDim.x + (int)threadIdx.x;
        if (j >= 4) continue;
        const int first = seq_start[seq], end = first + seq_rows[seq];
        // v30: [H] = seed d_c': read at the first row, then carried from a[18] of the row before
        float c6 = first < end ? args[(size_t)first * 19 + 6][j] : 0.0f;
        for (int row = first; row < end; ++row) {
            float* const* const a = args + (size_t)row * 19;
            // v22: [H] = sub v21, v14
            // v27: [H] = sub v21, v18
            // v31: [H] = mul v26, v0
            // v32: [H] = mul v26, v27
            // v33: [H] = neg v31
            // v34: [H] = mul v26, v24
            // v35: [H] = mul v26, v18
            // v36: [H] = add v30, v35
            // v37: [H] = mul v36, v8
            // v38: [H] = mul v36, v22
            // v39: [H] = neg v37
            // v42: [H] = mul v36, v1
            // v43: [H] = mul v36, v14
            // v44: [H] = add v33, v34
            // v48: [H] = mul v18, v27
            // v49: [H] = mul v44, v48
            // v50: [H] = mul v49, v1
            // v51: [H] = mul v49, v4
            // v52: [H] = add v39, v42
            // v56: [H] = mul v14, v22
            // v57: [H] = mul v52, v56
            // v58: [H] = mul v57, v1
            // v59: [H] = mul v57, v3
            const float t22 = (1e0f - a[1][j]);
            a[11][j] = t22;
            const float t27 = (1e0f - a[2][j]);
            const float t31 = (a[3][j] * a[4][j]);
            const float t32 = (a[3][j] * t27);
            a[12][j] = t32;
            const float t33 = -(t31);
            const float t34 = (a[3][j] * a[5][j]);
            const float t35 = (a[3][j] * a[2][j]);
            const float t36 = (c6 + t35);
            const float t37 = (t36 * a[7][j]);
            const float t38 = (t36 * t22);
            const float t39 = -(t37);
            const float t42 = (t36 * a[8][j]);
            const float t43 = (t36 * a[1][j]);
            const float t44 = (t33 + t34);
            const float t48 = (a[2][j] * t27);
            const float t49 = (t44 * t48);
            a[13][j] = t49;
            const float t50 = (t49 * a[8][j]);
            a[14][j] = t50;
            const float t51 = (t49 * a[9][j]);
            const float t52 = (t39 + t42);
            const float t56 = (a[1][j] * t22);
            const float t57 = (t52 * t56);
            a[15][j] = t57;
            const float t58 = (t57 * a[8][j]);
            a[16][j] = t58;
            const float t59 = (t57 * a[10][j]);
            // v63: [3*H] = concat v38, v57, v49
            a[17][j] = t38;
            a[17][4 + j] = t57;
            a[17][8 + j] = t49;
            // v66: [H] = add v43, v51
            // v67: [H] = add v66, v59
            const float t66 = (t43 + t51);
            const float t67 = (t66 + t59);
            a[18][j] = t67;
            c6 = t67;
        }
    }
}

// sru_bwd_s3: 1 values, 2 inputs, 1 outputs
//   a[0] in  v32: [H] = mul v26, v27
//   a[1] in  v65: [H] = matvect v2, v63
//   a[2] out v68: [H] = add v32, v65
// Lane form: one thread per (row, unit), 4 units; thread j computes element p * 4 + j of every vector.
__device__ __forceinline__ void sru_bwd_s3_row(float* const* __restrict__ a, int j) {
    // v68: [H] = add v32, v65
    const float t68 = (a[0][j] + a[1][j]);
    a[2][j] = t68;
}
extern "C" __global__ void sru_bwd_s3(float* const* __restrict__ args, int rows, float* __restrict__ scratch) {
    const int chunks = (4 + (int)blockDim.x - 1) / (int)blockDim.x;
    for (int item = blockIdx.x; item < rows * chunks; item += gridDim.x) {
        const int row = item / chunks;
        const int j = (item - row * chunks) * (int)blockDim.x + (int)threadIdx.x;
        if (j >= 4) continue;
        sru_bwd_s3_row(args + (size_t)row * 3, j);
    }
}

