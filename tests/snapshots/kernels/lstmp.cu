// lstmp_fwd_s2: 16 values, 5 inputs, 6 outputs
//   a[0] in  v8: [4*H] = matvec v3, v0
//   a[1] in  v5: [4*H] = param bias_ih
//   a[2] in  v10: [4*H] = matvec v4, v1
//   a[3] in  v6: [4*H] = param bias_hh
//   a[4] in  v2: [H] = state c
//   a[5] out v17: [H] = sigmoid v14
//   a[6] out v19: [H] = sigmoid v13
//   a[7] out v20: [H] = tanh v15
//   a[8] out v22: [H] = add v18, v21
//   a[9] out v23: [H] = sigmoid v16
//   a[10] out v25: [H] = mul v23, v24
// Lane form: one thread per (row, unit), 4 units; thread j computes element p * 4 + j of every vector.
__device__ __forceinline__ void lstmp_fwd_s2_row(float* const* __restrict__ a, int j) {
    // v9: [4*H] = add v8, v5
    // v11: [4*H] = add v9, v10
    // v12: [4*H] = add v11, v6
    const float t9_0 = (a[0][j] + a[1][j]);
    const float t11_0 = (t9_0 + a[2][j]);
    const float t12_0 = (t11_0 + a[3][j]);
    const float t9_1 = (a[0][4 + j] + a[1][4 + j]);
    const float t11_1 = (t9_1 + a[2][4 + j]);
    const float t12_1 = (t11_1 + a[3][4 + j]);
    const float t9_2 = (a[0][8 + j] + a[1][8 + j]);
    const float t11_2 = (t9_2 + a[2][8 + j]);
    const float t12_2 = (t11_2 + a[3][8 + j]);
    const float t9_3 = (a[0][12 + j] + a[1][12 + j]);
    const float t11_3 = (t9_3 + a[2][12 + j]);
    const float t12_3 = (t11_3 + a[3][12 + j]);
    // v13: [H] = slice v12, offset 0
    // v14: [H] = slice v12, offset H
    // v15: [H] = slice v12, offset 2*H
    // v16: [H] = slice v12, offset 3*H
    // v17: [H] = sigmoid v14
    // v18: [H] = mul v17, v2
    // v19: [H] = sigmoid v13
    // v20: [H] = tanh v15
    // v21: [H] = mul v19, v20
    // v22: [H] = add v18, v21
    // v23: [H] = sigmoid v16
    // v24: [H] = tanh v22
    // v25: [H] = mul v23, v24
    const float t17 = cellc_sigmoid(t12_1);
    a[5][j] = t17;
    const float t18 = (t17 * a[4][j]);
    const float t19 = cellc_sigmoid(t12_0);
    a[6][j] = t19;
    const float t20 = tanhf(t12_2);
    a[7][j] = t20;
    const float t21 = (t19 * t20);
    const float t22 = (t18 + t21);
    a[8][j] = t22;
    const float t23 = cellc_sigmoid(t12_3);
    a[9][j] = t23;
    const float t24 = tanhf(t22);
    const float t25 = (t23 * t24);
    a[10][j] = t25;
}
extern "C" __global__ void lstmp_fwd_s2(float* const* __restrict__ args, int rows, float* __restrict__ scratch) {
    const int chunks = (4 + (int)blockDim.x - 1) / (int)blockDim.x;
    for (int item = blockIdx.x; item < rows * chunks; item += gridDim.x) {
        const int row = item / chunks;
        const int j = (item - row * chunks) * (int)blockDim.x + (int)threadIdx.x;
        if (j >= 4) continue;
        lstmp_fwd_s2_row(args + (size_t)row * 11, j);
    }
}

// lstmp_bwd_s0: 3 values, 4 inputs, 3 outputs
//   a[0] in  v22: [H] = add v18, v21
//   a[1] in  v23: [H] = sigmoid v16
//   a[2] in  v27: [P] = seed d_output
//   a[3] in  v28: [P] = seed d_h'
//   a[4] out v24: [H] = tanh v22
//   a[5] out v25: [H] = mul v23, v24
//   a[6] out v30: [P] = add v27, v28
// Lane form: one thread per (row, unit), 2 units; thread j computes element p * 2 + j of every vector.
__device__ __forceinline__ void lstmp_bwd_s0_row(float* const* __restrict__ a, int j) {
    // v24: [H] = tanh v22
    // v25: [H] = mul v23, v24
    const float t24_0 = tanhf(a[0][j]);
    a[4][j] = t24_0;
    const float t25_0 = (a[1][j] * t24_0);
    a[5][j] = t25_0;
    const float t24_1 = tanhf(a[0][2 + j]);
    a[4][2 + j] = t24_1;
    const float t25_1 = (a[1][2 + j] * t24_1);
    a[5][2 + j] = t25_1;
    // v30: [P] = add v27, v28
    const float t30 = (a[2][j] + a[3][j]);
    a[6][j] = t30;
}
extern "C" __global__ void lstmp_bwd_s0(float* const* __restrict__ args, int rows, float* __restrict__ scratch) {
    const int chunks = (2 + (int)blockDim.x - 1) / (int)blockDim.x;
    for (int item = blockIdx.x; item < rows * chunks; item += gridDim.x) {
        const int row = item / chunks;
        const int j = (item - row * chunks) * (int)blockDim.x + (int)threadIdx.x;
        if (j >= 2) continue;
        lstmp_bwd_s0_row(args + (size_t)row * 7, j);
    }
}

// lstmp_bwd_s2: 23 values, 9 inputs, 2 outputs
//   a[0] in  v32: [H] = matvect v7, v30
//   a[1] in  v24: [H] = tanh v22
//   a[2] in  v23: [H] = sigmoid v16
//   a[3] in  v36: [H] = broadcast v35
//   a[4] in  v29: [H] = seed d_c'
//   a[5] in  v20: [H] = tanh v15
//   a[6] in  v19: [H] = sigmoid v13
//   a[7] in  v2: [H] = state c
//   a[8] in  v17: [H] = sigmoid v14
//   a[9] out v59: [H] = mul v45, v17
//   a[10] out v69: [4*H] = concat v57, v64, v52, v44
// Lane form: one thread per (row, unit), 4 units; thread j computes element p * 4 + j of every vector.
__device__ __forceinline__ void lstmp_bwd_s2_row(float* const* __restrict__ a, int j) {
    // v33: [H] = mul v32, v24
    // v34: [H] = mul v32, v23
    // v37: [H] = mul v24, v24
    // v38: [H] = sub v36, v37
    // v39: [H] = mul v34, v38
    // v42: [H] = sub v36, v23
    // v43: [H] = mul v23, v42
    // v44: [H] = mul v33, v43
    // v45: [H] = add v29, v39
    // v46: [H] = mul v45, v20
    // v47: [H] = mul v45, v19
    // v50: [H] = mul v20, v20
    // v51: [H] = sub v36, v50
    // v52: [H] = mul v47, v51
    // v55: [H] = sub v36, v19
    // v56: [H] = mul v19, v55
    // v57: [H] = mul v46, v56
    // v58: [H] = mul v45, v2
    // v59: [H] = mul v45, v17
    // v62: [H] = sub v36, v17
    // v63: [H] = mul v17, v62
    // v64: [H] = mul v58, v63
    const float t33 = (a[0][j] * a[1][j]);
    const float t34 = (a[0][j] * a[2][j]);
    const float t37 = (a[1][j] * a[1][j]);
    const float t38 = (1e0f - t37);
    const float t39 = (t34 * t38);
    const float t42 = (1e0f - a[2][j]);
    const float t43 = (a[2][j] * t42);
    const float t44 = (t33 * t43);
    const float t45 = (a[4][j] + t39);
    const float t46 = (t45 * a[5][j]);
    const float t47 = (t45 * a[6][j]);
    const float t50 = (a[5][j] * a[5][j]);
    const float t51 = (1e0f - t50);
    const float t52 = (t47 * t51);
    const float t55 = (1e0f - a[6][j]);
    const float t56 = (a[6][j] * t55);
    const float t57 = (t46 * t56);
    const float t58 = (t45 * a[7][j]);
    const float t59 = (t45 * a[8][j]);
    a[9][j] = t59;
    const float t62 = (1e0f - a[8][j]);
    const float t63 = (a[8][j] * t62);
    const float t64 = (t58 * t63);
    // v69: [4*H] = concat v57, v64, v52, v44
    a[10][j] = t57;
    a[10][4 + j] = t64;
    a[10][8 + j] = t52;
    a[10][12 + j] = t44;
}
extern "C" __global__ void lstmp_bwd_s2(float* const* __restrict__ args, int rows, float* __restrict__ scratch) {
    const int chunks = (4 + (int)blockDim.x - 1) / (int)blockDim.x;
    for (int item = blockIdx.x; item < rows * chunks; item += gridDim.x) {
        const int row = item / chunks;
        const int j = (item - row * chunks) * (int)blockDim.x + (int)threadIdx.x;
        if (j >= 4) continue;
        lstmp_bwd_s2_row(args + (size_t)row * 11, j);
    }
}

