// lstm_fwd_s2: 16 values, 5 inputs, 6 outputs
//   a[0] in  v7: [4*H] = matvec v3, v0
//   a[1] in  v5: [4*H] = param bias_ih
//   a[2] in  v9: [4*H] = matvec v4, v1
//   a[3] in  v6: [4*H] = param bias_hh
//   a[4] in  v2: [H] = state c
//   a[5] out v16: [H] = sigmoid v13
//   a[6] out v18: [H] = sigmoid v12
//   a[7] out v19: [H] = tanh v14
//   a[8] out v21: [H] = add v17, v20
//   a[9] out v22: [H] = sigmoid v15
//   a[10] out v24: [H] = mul v22, v23
// Lane form: one thread per (row, unit), 4 units; thread j computes element p * 4 + j of every vector.
__device__ __forceinline__ void lstm_fwd_s2_row(float* const* __restrict__ a, int j) {
    // v8: [4*H] = add v7, v5
    // v10: [4*H] = add v8, v9
    // v11: [4*H] = add v10, v6
    const float t8_0 = (a[0][j] + a[1][j]);
    const float t10_0 = (t8_0 + a[2][j]);
    const float t11_0 = (t10_0 + a[3][j]);
    const float t8_1 = (a[0][4 + j] + a[1][4 + j]);
    const float t10_1 = (t8_1 + a[2][4 + j]);
    const float t11_1 = (t10_1 + a[3][4 + j]);
    const float t8_2 = (a[0][8 + j] + a[1][8 + j]);
    const float t10_2 = (t8_2 + a[2][8 + j]);
    const float t11_2 = (t10_2 + a[3][8 + j]);
    const float t8_3 = (a[0][12 + j] + a[1][12 + j]);
    const float t10_3 = (t8_3 + a[2][12 + j]);
    const float t11_3 = (t10_3 + a[3][12 + j]);
    // v12: [H] = slice v11, offset 0
    // v13: [H] = slice v11, offset H
    // v14: [H] = slice v11, offset 2*H
    // v15: [H] = slice v11, offset 3*H
    // v16: [H] = sigmoid v13
    // v17: [H] = mul v16, v2
    // v18: [H] = sigmoid v12
    // v19: [H] = tanh v14
    // v20: [H] = mul v18, v19
    // v21: [H] = add v17, v20
    // v22: [H] = sigmoid v15
    // v23: [H] = tanh v21
    // v24: [H] = mul v22, v23
    const float t16 = cellc_sigmoid(t11_1);
    a[5][j] = t16;
    const float t17 = (t16 * a[4][j]);
    const float t18 = cellc_sigmoid(t11_0);
    a[6][j] = t18;
    const float t19 = tanhf(t11_2);
    a[7][j] = t19;
    const float t20 = (t18 * t19);
    const float t21 = (t17 + t20);
    a[8][j] = t21;
    const float t22 = cellc_sigmoid(t11_3);
    a[9][j] = t22;
    const float t23 = tanhf(t21);
    const float t24 = (t22 * t23);
    a[10][j] = t24;
}
extern "C" __global__ void lstm_fwd_s2(float* const* __restrict__ args, int rows, float* __restrict__ scratch) {
    const int chunks = (4 + (int)blockDim.x - 1) / (int)blockDim.x;
    for (int item = blockIdx.x; item < rows * chunks; item += gridDim.x) {
        const int row = item / chunks;
        const int j = (item - row * chunks) * (int)blockDim.x + (int)threadIdx.x;
        if (j >= 4) continue;
        lstm_fwd_s2_row(args + (size_t)row * 11, j);
    }
}

// lstm_bwd_s0: 25 values, 10 inputs, 2 outputs
//   a[0] in  v21: [H] = add v17, v20
//   a[1] in  v25: [H] = seed d_output
//   a[2] in  v26: [H] = seed d_h'
//   a[3] in  v22: [H] = sigmoid v15
//   a[4] in  v32: [H] = broadcast v31
//   a[5] in  v27: [H] = seed d_c'
//   a[6] in  v19: [H] = tanh v14
//   a[7] in  v18: [H] = sigmoid v12
//   a[8] in  v2: [H] = state c
//   a[9] in  v16: [H] = sigmoid v13
//   a[10] out v55: [H] = mul v41, v16
//   a[11] out v65: [4*H] = concat v53, v60, v48, v40
// Lane form: one thread per (row, unit), 4 units; thread j computes element p * 4 + j of every vector.
__device__ __forceinline__ void lstm_bwd_s0_row(float* const* __restrict__ a, int j) {
    // v23: [H] = tanh v21
    // v28: [H] = add v25, v26
    // v29: [H] = mul v28, v23
    // v30: [H] = mul v28, v22
    // v33: [H] = mul v23, v23
    // v34: [H] = sub v32, v33
    // v35: [H] = mul v30, v34
    // v38: [H] = sub v32, v22
    // v39: [H] = mul v22, v38
    // v40: [H] = mul v29, v39
    // v41: [H] = add v27, v35
    // v42: [H] = mul v41, v19
    // v43: [H] = mul v41, v18
    // v46: [H] = mul v19, v19
    // v47: [H] = sub v32, v46
    // v48: [H] = mul v43, v47
    // v51: [H] = sub v32, v18
    // v52: [H] = mul v18, v51
    // v53: [H] = mul v42, v52
    // v54: [H] = mul v41, v2
    // v55: [H] = mul v41, v16
    // v58: [H] = sub v32, v16
    // v59: [H] = mul v16, v58
    // v60: [H] = mul v54, v59
    const float t23 = tanhf(a[0][j]);
    const float t28 = (a[1][j] + a[2][j]);
    const float t29 = (t28 * t23);
    const float t30 = (t28 * a[3][j]);
    const float t33 = (t23 * t23);
    const float t34 = (1e0f - t33);
    const float t35 = (t30 * t34);
    const float t38 = (1e0f - a[3][j]);
    const float t39 = (a[3][j] * t38);
    const float t40 = (t29 * t39);
    const float t41 = (a[5][j] + t35);
    const float t42 = (t41 * a[6][j]);
    const float t43 = (t41 * a[7][j]);
    const float t46 = (a[6][j] * a[6][j]);
    const float t47 = (1e0f - t46);
    const float t48 = (t43 * t47);
    const float t51 = (1e0f - a[7][j]);
    const float t52 = (a[7][j] * t51);
    const float t53 = (t42 * t52);
    const float t54 = (t41 * a[8][j]);
    const float t55 = (t41 * a[9][j]);
    a[10][j] = t55;
    const float t58 = (1e0f - a[9][j]);
    const float t59 = (a[9][j] * t58);
    const float t60 = (t54 * t59);
    // v65: [4*H] = concat v53, v60, v48, v40
    a[11][j] = t53;
    a[11][4 + j] = t60;
    a[11][8 + j] = t48;
    a[11][12 + j] = t40;
}
extern "C" __global__ void lstm_bwd_s0(float* const* __restrict__ args, int rows, float* __restrict__ scratch) {
    const int chunks = (4 + (int)blockDim.x - 1) / (int)blockDim.x;
    for (int item = blockIdx.x; item < rows * chunks; item += gridDim.x) {
        const int row = item / chunks;
        const int j = (item - row * chunks) * (int)blockDim.x + (int)threadIdx.x;
        if (j >= 4) continue;
        lstm_bwd_s0_row(args + (size_t)row * 12, j);
    }
}

