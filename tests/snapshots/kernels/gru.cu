// gru_fwd_s2: 20 values, 6 inputs, 5 outputs
//   a[0] in  v6: [3*H] = matvec v2, v0
//   a[1] in  v4: [3*H] = param bias_ih
//   a[2] in  v11: [3*H] = matvec v3, v1
//   a[3] in  v5: [3*H] = param bias_hh
//   a[4] in  v23: f32 = const 1
//   a[5] in  v1: [H] = state h
//   a[6] out v15: [H] = slice v12, offset 2*H
//   a[7] out v17: [H] = sigmoid v16
//   a[8] out v19: [H] = sigmoid v18
//   a[9] out v22: [H] = tanh v21
//   a[10] out v28: [H] = add v26, v27
// Lane form: one thread per (row, unit), 4 units; thread j computes element p * 4 + j of every vector.
__device__ __forceinline__ void gru_fwd_s2_row(float* const* __restrict__ a, int j) {
    // v7: [3*H] = add v6, v4
    const float t7_0 = (a[0][j] + a[1][j]);
    const float t7_1 = (a[0][4 + j] + a[1][4 + j]);
    const float t7_2 = (a[0][8 + j] + a[1][8 + j]);
    // v8: [H] = slice v7, offset 0
    // v9: [H] = slice v7, offset H
    // v10: [H] = slice v7, offset 2*H
    // v12: [3*H] = add v11, v5
    const float t12_0 = (a[2][j] + a[3][j]);
    const float t12_1 = (a[2][4 + j] + a[3][4 + j]);
    const float t12_2 = (a[2][8 + j] + a[3][8 + j]);
    // v13: [H] = slice v12, offset 0
    // v14: [H] = slice v12, offset H
    // v15: [H] = slice v12, offset 2*H
    // v16: [H] = add v8, v13
    // v17: [H] = sigmoid v16
    // v18: [H] = add v9, v14
    // v19: [H] = sigmoid v18
    // v20: [H] = mul v17, v15
    // v21: [H] = add v10, v20
    // v22: [H] = tanh v21
    // v25: [H] = sub v24, v19
    // v26: [H] = mul v25, v22
    // v27: [H] = mul v19, v1
    // v28: [H] = add v26, v27
    const float t16 = (t7_0 + t12_0);
    const float t17 = cellc_sigmoid(t16);
    a[7][j] = t17;
    const float t18 = (t7_1 + t12_1);
    const float t19 = cellc_sigmoid(t18);
    a[8][j] = t19;
    const float t20 = (t17 * t12_2);
    const float t21 = (t7_2 + t20);
    const float t22 = tanhf(t21);
    a[9][j] = t22;
    const float t25 = (1e0f - t19);
    const float t26 = (t25 * t22);
    const float t27 = (t19 * a[5][j]);
    const float t28 = (t26 + t27);
    a[10][j] = t28;
    // output v15
    a[6][j] = t12_2;
}
extern "C" __global__ void gru_fwd_s2(float* const* __restrict__ args, int rows, float* __restrict__ scratch) {
    const int chunks = (4 + (int)blockDim.x - 1) / (int)blockDim.x;
    for (int item = blockIdx.x; item < rows * chunks; item += gridDim.x) {
        const int row = item / chunks;
        const int j = (item - row * chunks) * (int)blockDim.x + (int)threadIdx.x;
        if (j >= 4) continue;
        gru_fwd_s2_row(args + (size_t)row * 11, j);
    }
}

// gru_bwd_s0: 19 values, 8 inputs, 3 outputs
//   a[0] in  v24: [H] = broadcast v23
//   a[1] in  v19: [H] = sigmoid v18
//   a[2] in  v29: [H] = seed d_output
//   a[3] in  v30: [H] = seed d_h'
//   a[4] in  v1: [H] = state h
//   a[5] in  v22: [H] = tanh v21
//   a[6] in  v15: [H] = slice v12, offset 2*H
//   a[7] in  v17: [H] = sigmoid v16
//   a[8] out v33: [H] = mul v31, v19
//   a[9] out v59: [3*H] = concat v55, v50, v44
//   a[10] out v65: [3*H] = concat v55, v50, v42
// Lane form: one thread per (row, unit), 4 units; thread j computes element p * 4 + j of every vector.
__device__ __forceinline__ void gru_bwd_s0_row(float* const* __restrict__ a, int j) {
    // v25: [H] = sub v24, v19
    // v31: [H] = add v29, v30
    // v32: [H] = mul v31, v1
    // v33: [H] = mul v31, v19
    // v34: [H] = mul v31, v22
    // v35: [H] = mul v31, v25
    // v40: [H] = mul v22, v22
    // v41: [H] = sub v24, v40
    // v42: [H] = mul v35, v41
    // v43: [H] = mul v42, v15
    // v44: [H] = mul v42, v17
    // v45: [H] = sub v32, v34
    // v49: [H] = mul v19, v25
    // v50: [H] = mul v45, v49
    // v53: [H] = sub v24, v17
    // v54: [H] = mul v17, v53
    // v55: [H] = mul v43, v54
    const float t25 = (1e0f - a[1][j]);
    const float t31 = (a[2][j] + a[3][j]);
    const float t32 = (t31 * a[4][j]);
    const float t33 = (t31 * a[1][j]);
    a[8][j] = t33;
    const float t34 = (t31 * a[5][j]);
    const float t35 = (t31 * t25);
    const float t40 = (a[5][j] * a[5][j]);
    const float t41 = (1e0f - t40);
    const float t42 = (t35 * t41);
    const float t43 = (t42 * a[6][j]);
    const float t44 = (t42 * a[7][j]);
    const float t45 = (t32 - t34);
    const float t49 = (a[1][j] * t25);
    const float t50 = (t45 * t49);
    const float t53 = (1e0f - a[7][j]);
    const float t54 = (a[7][j] * t53);
    const float t55 = (t43 * t54);
    // v59: [3*H] = concat v55, v50, v44
    a[9][j] = t55;
    a[9][4 + j] = t50;
    a[9][8 + j] = t44;
    // v65: [3*H] = concat v55, v50, v42
    a[10][j] = t55;
    a[10][4 + j] = t50;
    a[10][8 + j] = t42;
}
extern "C" __global__ void gru_bwd_s0(float* const* __restrict__ args, int rows, float* __restrict__ scratch) {
    const int chunks = (4 + (int)blockDim.x - 1) / (int)blockDim.x;
    for (int item = blockIdx.x; item < rows * chunks; item += gridDim.x) {
        const int row = item / chunks;
        const int j = (item - row * chunks) * (int)blockDim.x + (int)threadIdx.x;
        if (j >= 4) continue;
        gru_bwd_s0_row(args + (size_t)row * 11, j);
    }
}

// gru_bwd_s2: 1 values, 2 inputs, 1 outputs
//   a[0] in  v33: [H] = mul v31, v19
//   a[1] in  v61: [H] = matvect v3, v59
//   a[2] out v68: [H] = add v33, v61
// Lane form: one thread per (row, unit), 4 units; thread j computes element p * 4 + j of every vector.
__device__ __forceinline__ void gru_bwd_s2_row(float* const* __restrict__ a, int j) {
    // v68: [H] = add v33, v61
    const float t68 = (a[0][j] + a[1][j]);
    a[2][j] = t68;
}
extern "C" __global__ void gru_bwd_s2(float* const* __restrict__ args, int rows, float* __restrict__ scratch) {
    const int chunks = (4 + (int)blockDim.x - 1) / (int)blockDim.x;
    for (int item = blockIdx.x; item < rows * chunks; item += gridDim.x) {
        const int row = item / chunks;
        const int j = (item - row * chunks) * (int)blockDim.x + (int)threadIdx.x;
        if (j >= 4) continue;
        gru_bwd_s2_row(args + (size_t)row * 3, j);
    }
}

