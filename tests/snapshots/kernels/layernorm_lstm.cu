// layernorm_lstm_fwd_s2: 47 values, 10 inputs, 8 outputs
//   a[0] in  v11: [4*H] = matvec v3, v0
//   a[1] in  v17: f32 = const 0.00001
//   a[2] in  v5: [4*H] = param layernorm_i_weight
//   a[3] in  v6: [4*H] = param layernorm_i_bias
//   a[4] in  v24: [4*H] = matvec v4, v1
//   a[5] in  v7: [4*H] = param layernorm_h_weight
//   a[6] in  v8: [4*H] = param layernorm_h_bias
//   a[7] in  v2: [H] = state c
//   a[8] in  v9: [H] = param layernorm_c_weight
//   a[9] in  v10: [H] = param layernorm_c_bias
//   a[10] out v14: [4*H] = sub v11, v13
//   a[11] out v18: f32 = add v16, v17
//   a[12] out v27: [4*H] = sub v24, v26
//   a[13] out v30: f32 = add v29, v17
//   a[14] out v47: f32 = mean v46
//   a[15] out v52: f32 = add v51, v17
//   a[16] out v57: [H] = add v56, v10
//   a[17] out v60: [H] = mul v58, v59
__device__ __forceinline__ void layernorm_lstm_fwd_s2_row(float* const* __restrict__ a, float* __restrict__ s, float* red) {
    // v12: f32 = mean v11
    const float u12 = cellc_block_sum(a[0], 16, red) / 1.6e1f;
    // v13: [4*H] = broadcast v12
    // v14: [4*H] = sub v11, v13
    // v15: [4*H] = mul v14, v14
    for (int j = threadIdx.x; j < 16; j += blockDim.x) {
        const float t14 = (a[0][j] - u12);
        a[10][j] = t14;
        const float t15 = (t14 * t14);
        (s + 0)[j] = t15;
    }
    __syncthreads();
    // v16: f32 = mean v15
    const float u16 = cellc_block_sum((s + 0), 16, red) / 1.6e1f;
    // v18: f32 = add v16, v17
    const float u18 = (u16 + 1e-5f);
    // v19: f32 = rsqrt v18
    const float u19 = (1.0f / sqrtf(u18));
    // v20: [4*H] = broadcast v19
    // v25: f32 = mean v24
    const float u25 = cellc_block_sum(a[4], 16, red) / 1.6e1f;
    // v26: [4*H] = broadcast v25
    // v21: [4*H] = mul v14, v20
    // v22: [4*H] = mul v21, v5
    // v23: [4*H] = add v22, v6
    // v27: [4*H] = sub v24, v26
    // v28: [4*H] = mul v27, v27
    for (int j = threadIdx.x; j < 16; j += blockDim.x) {
        const float t21 = (a[10][j] * u19);
        const float t22 = (t21 * a[2][j]);
        const float t23 = (t22 + a[3][j]);
        (s + 16)[j] = t23;
        const float t27 = (a[4][j] - u25);
        a[12][j] = t27;
        const float t28 = (t27 * t27);
        (s + 32)[j] = t28;
    }
    __syncthreads();
    // v29: f32 = mean v28
    const float u29 = cellc_block_sum((s + 32), 16, red) / 1.6e1f;
    // v30: f32 = add v29, v17
    const float u30 = (u29 + 1e-5f);
    // v31: f32 = rsqrt v30
    const float u31 = (1.0f / sqrtf(u30));
    // v32: [4*H] = broadcast v31
    // v33: [4*H] = mul v27, v32
    // v34: [4*H] = mul v33, v7
    // v35: [4*H] = add v34, v8
    // v36: [4*H] = add v23, v35
    for (int j = threadIdx.x; j < 16; j += blockDim.x) {
        const float t33 = (a[12][j] * u31);
        const float t34 = (t33 * a[5][j]);
        const float t35 = (t34 + a[6][j]);
        const float t36 = ((s + 16)[j] + t35);
        (s + 48)[j] = t36;
    }
    __syncthreads();
    // v37: [H] = slice v36, offset 0
    // v38: [H] = slice v36, offset H
    // v39: [H] = slice v36, offset 2*H
    // v40: [H] = slice v36, offset 3*H
    // v41: [H] = sigmoid v38
    // v42: [H] = mul v41, v2
    // v43: [H] = sigmoid v37
    // v44: [H] = tanh v39
    // v45: [H] = mul v43, v44
    // v46: [H] = add v42, v45
    for (int j = threadIdx.x; j < 4; j += blockDim.x) {
        const float t41 = cellc_sigmoid(((s + 48) + 4)[j]);
        const float t42 = (t41 * a[7][j]);
        const float t43 = cellc_sigmoid(((s + 48) + 0)[j]);
        const float t44 = tanhf(((s + 48) + 8)[j]);
        const float t45 = (t43 * t44);
        const float t46 = (t42 + t45);
        (s + 64)[j] = t46;
    }
    __syncthreads();
    // v47: f32 = mean v46
    const float u47 = cellc_block_sum((s + 64), 4, red) / 4e0f;
    // v48: [H] = broadcast v47
    // v49: [H] = sub v46, v48
    // v50: [H] = mul v49, v49
    for (int j = threadIdx.x; j < 4; j += blockDim.x) {
        const float t49 = ((s + 64)[j] - u47);
        (s + 68)[j] = t49;
        const float t50 = (t49 * t49);
        (s + 72)[j] = t50;
    }
    __syncthreads();
    // v51: f32 = mean v50
    const float u51 = cellc_block_sum((s + 72), 4, red) / 4e0f;
    // v52: f32 = add v51, v17
    const float u52 = (u51 + 1e-5f);
    // v53: f32 = rsqrt v52
    const float u53 = (1.0f / sqrtf(u52));
    // v54: [H] = broadcast v53
    // v55: [H] = mul v49, v54
    // v56: [H] = mul v55, v9
    // v57: [H] = add v56, v10
    // v58: [H] = sigmoid v40
    // v59: [H] = tanh v57
    // v60: [H] = mul v58, v59
    for (int j = threadIdx.x; j < 4; j += blockDim.x) {
        const float t55 = ((s + 68)[j] * u53);
        const float t56 = (t55 * a[8][j]);
        const float t57 = (t56 + a[9][j]);
        a[16][j] = t57;
        const float t58 = cellc_sigmoid(((s + 48) + 12)[j]);
        const float t59 = tanhf(t57);
        const float t60 = (t58 * t59);
        a[17][j] = t60;
    }
    __syncthreads();
    // output v18
    for (int j = threadIdx.x; j < 1; j += blockDim.x) a[11][j] = u18;
    // output v30
    for (int j = threadIdx.x; j < 1; j += blockDim.x) a[13][j] = u30;
    // output v47
    for (int j = threadIdx.x; j < 1; j += blockDim.x) a[14][j] = u47;
    // output v52
    for (int j = threadIdx.x; j < 1; j += blockDim.x) a[15][j] = u52;
}
extern "C" __global__ void __launch_bounds__(128) layernorm_lstm_fwd_s2(float* const* __restrict__ args, int rows, float* __restrict__ scratch) {
    __shared__ float red[128];
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        layernorm_lstm_fwd_s2_row(args + (size_t)row * 18, scratch + (size_t)blockIdx.x * 76, red);
        __syncthreads();
    }
}

// layernorm_lstm_bwd_s0: 106 values, 20 inputs, 11 outputs
//   a[0] in  v18: f32 = add v16, v17
//   a[1] in  v14: [4*H] = sub v11, v13
//   a[2] in  v5: [4*H] = param layernorm_i_weight
//   a[3] in  v6: [4*H] = param layernorm_i_bias
//   a[4] in  v30: f32 = add v29, v17
//   a[5] in  v27: [4*H] = sub v24, v26
//   a[6] in  v7: [4*H] = param layernorm_h_weight
//   a[7] in  v8: [4*H] = param layernorm_h_bias
//   a[8] in  v2: [H] = state c
//   a[9] in  v47: f32 = mean v46
//   a[10] in  v52: f32 = add v51, v17
//   a[11] in  v57: [H] = add v56, v10
//   a[12] in  v61: [H] = seed d_output
//   a[13] in  v62: [H] = seed d_h'
//   a[14] in  v68: [H] = broadcast v67
//   a[15] in  v63: [H] = seed d_c'
//   a[16] in  v9: [H] = param layernorm_c_weight
//   a[17] in  v83: f32 = const -0.5
//   a[18] in  v87: f32 = dimvalue H
//   a[19] in  v133: f32 = dimvalue 4*H
//   a[20] out v46: [H] = add v42, v45
//   a[21] out v49: [H] = sub v46, v48
//   a[22] out v55: [H] = mul v49, v54
//   a[23] out v77: [H] = add v63, v71
//   a[24] out v79: [H] = mul v77, v55
//   a[25] out v113: [H] = mul v99, v41
//   a[26] out v123: [4*H] = concat v111, v118, v106, v76
//   a[27] out v125: [4*H] = mul v123, v33
//   a[28] out v149: [4*H] = mul v123, v21
//   a[29] out v145: [4*H] = add v139, v144
//   a[30] out v171: [4*H] = add v165, v170
__device__ __forceinline__ void layernorm_lstm_bwd_s0_row(float* const* __restrict__ a, float* __restrict__ s, float* red) {
    // v19: f32 = rsqrt v18
    const float u19 = (1.0f / sqrtf(a[0][0]));
    // v20: [4*H] = broadcast v19
    // v31: f32 = rsqrt v30
    const float u31 = (1.0f / sqrtf(a[4][0]));
    // v32: [4*H] = broadcast v31
    // v21: [4*H] = mul v14, v20
    // v22: [4*H] = mul v21, v5
    // v23: [4*H] = add v22, v6
    // v33: [4*H] = mul v27, v32
    // v34: [4*H] = mul v33, v7
    // v35: [4*H] = add v34, v8
    // v36: [4*H] = add v23, v35
    for (int j = threadIdx.x; j < 16; j += blockDim.x) {
        const float t21 = (a[1][j] * u19);
        (s + 0)[j] = t21;
        const float t22 = (t21 * a[2][j]);
        const float t23 = (t22 + a[3][j]);
        const float t33 = (a[5][j] * u31);
        (s + 16)[j] = t33;
        const float t34 = (t33 * a[6][j]);
        const float t35 = (t34 + a[7][j]);
        const float t36 = (t23 + t35);
        (s + 32)[j] = t36;
    }
    __syncthreads();
    // v37: [H] = slice v36, offset 0
    // v38: [H] = slice v36, offset H
    // v39: [H] = slice v36, offset 2*H
    // v40: [H] = slice v36, offset 3*H
    // v48: [H] = broadcast v47
    // v53: f32 = rsqrt v52
    const float u53 = (1.0f / sqrtf(a[10][0]));
    // v54: [H] = broadcast v53
    // v41: [H] = sigmoid v38
    // v42: [H] = mul v41, v2
    // v43: [H] = sigmoid v37
    // v44: [H] = tanh v39
    // v45: [H] = mul v43, v44
    // v46: [H] = add v42, v45
    // v49: [H] = sub v46, v48
    // v55: [H] = mul v49, v54
    // v58: [H] = sigmoid v40
    // v59: [H] = tanh v57
    // v64: [H] = add v61, v62
    // v65: [H] = mul v64, v59
    // v66: [H] = mul v64, v58
    // v69: [H] = mul v59, v59
    // v70: [H] = sub v68, v69
    // v71: [H] = mul v66, v70
    // v74: [H] = sub v68, v58
    // v75: [H] = mul v58, v74
    // v76: [H] = mul v65, v75
    // v77: [H] = add v63, v71
    // v78: [H] = mul v77, v9
    // v79: [H] = mul v77, v55
    // v80: [H] = mul v78, v54
    // v81: [H] = mul v78, v49
    for (int j = threadIdx.x; j < 4; j += blockDim.x) {
        const float t41 = cellc_sigmoid(((s + 32) + 4)[j]);
        (s + 48)[j] = t41;
        const float t42 = (t41 * a[8][j]);
        const float t43 = cellc_sigmoid(((s + 32) + 0)[j]);
        (s + 52)[j] = t43;
        const float t44 = tanhf(((s + 32) + 8)[j]);
        (s + 56)[j] = t44;
        const float t45 = (t43 * t44);
        const float t46 = (t42 + t45);
        a[20][j] = t46;
        const float t49 = (t46 - a[9][0]);
        a[21][j] = t49;
        const float t55 = (t49 * u53);
        a[22][j] = t55;
        const float t58 = cellc_sigmoid(((s + 32) + 12)[j]);
        const float t59 = tanhf(a[11][j]);
        const float t64 = (a[12][j] + a[13][j]);
        const float t65 = (t64 * t59);
        const float t66 = (t64 * t58);
        const float t69 = (t59 * t59);
        const float t70 = (1e0f - t69);
        const float t71 = (t66 * t70);
        const float t74 = (1e0f - t58);
        const float t75 = (t58 * t74);
        const float t76 = (t65 * t75);
        (s + 60)[j] = t76;
        const float t77 = (a[15][j] + t71);
        a[23][j] = t77;
        const float t78 = (t77 * a[16][j]);
        const float t79 = (t77 * t55);
        a[24][j] = t79;
        const float t80 = (t78 * u53);
        (s + 64)[j] = t80;
        const float t81 = (t78 * t49);
        (s + 68)[j] = t81;
    }
    __syncthreads();
    // v82: f32 = sum v81
    const float u82 = cellc_block_sum((s + 68), 4, red);
    // v84: f32 = mul v82, v53
    const float u84 = (u82 * u53);
    // v85: f32 = div v84, v52
    const float u85 = (u84 / a[10][0]);
    // v86: f32 = mul v85, v83
    const float u86 = (u85 * -5e-1f);
    // v88: f32 = div v86, v87
    const float u88 = (u86 / 4e0f);
    // v89: [H] = broadcast v88
    // v90: [H] = mul v89, v49
    // v92: [H] = add v80, v90
    // v93: [H] = add v92, v90
    // v104: [H] = mul v44, v44
    // v105: [H] = sub v68, v104
    // v109: [H] = sub v68, v43
    // v110: [H] = mul v43, v109
    // v116: [H] = sub v68, v41
    // v117: [H] = mul v41, v116
    for (int j = threadIdx.x; j < 4; j += blockDim.x) {
        const float t90 = (u88 * a[21][j]);
        const float t92 = ((s + 64)[j] + t90);
        const float t93 = (t92 + t90);
        (s + 72)[j] = t93;
        const float t104 = ((s + 56)[j] * (s + 56)[j]);
        const float t105 = (1e0f - t104);
        (s + 76)[j] = t105;
        const float t109 = (1e0f - (s + 52)[j]);
        const float t110 = ((s + 52)[j] * t109);
        (s + 80)[j] = t110;
        const float t116 = (1e0f - (s + 48)[j]);
        const float t117 = ((s + 48)[j] * t116);
        (s + 84)[j] = t117;
    }
    __syncthreads();
    // v158: f32 = sum v93
    const float u158 = cellc_block_sum((s + 72), 4, red);
    // v95: f32 = neg v158
    const float u95 = -(u158);
    // v97: f32 = div v95, v87
    const float u97 = (u95 / 4e0f);
    // v98: [H] = broadcast v97
    // v99: [H] = add v93, v98
    // v100: [H] = mul v99, v44
    // v101: [H] = mul v99, v43
    // v106: [H] = mul v101, v105
    // v111: [H] = mul v100, v110
    // v112: [H] = mul v99, v2
    // v113: [H] = mul v99, v41
    // v118: [H] = mul v112, v117
    for (int j = threadIdx.x; j < 4; j += blockDim.x) {
        const float t99 = ((s + 72)[j] + u97);
        const float t100 = (t99 * (s + 56)[j]);
        const float t101 = (t99 * (s + 52)[j]);
        const float t106 = (t101 * (s + 76)[j]);
        (s + 88)[j] = t106;
        const float t111 = (t100 * (s + 80)[j]);
        (s + 92)[j] = t111;
        const float t112 = (t99 * a[8][j]);
        const float t113 = (t99 * (s + 48)[j]);
        a[25][j] = t113;
        const float t118 = (t112 * (s + 84)[j]);
        (s + 96)[j] = t118;
    }
    __syncthreads();
    // v123: [4*H] = concat v111, v118, v106, v76
    for (int j = threadIdx.x; j < 4; j += blockDim.x) a[26][0 + j] = (s + 92)[j];
    for (int j = threadIdx.x; j < 4; j += blockDim.x) a[26][4 + j] = (s + 96)[j];
    for (int j = threadIdx.x; j < 4; j += blockDim.x) a[26][8 + j] = (s + 88)[j];
    for (int j = threadIdx.x; j < 4; j += blockDim.x) a[26][12 + j] = (s + 60)[j];
    __syncthreads();
    // v124: [4*H] = mul v123, v7
    // v125: [4*H] = mul v123, v33
    // v126: [4*H] = mul v124, v32
    // v127: [4*H] = mul v124, v27
    for (int j = threadIdx.x; j < 16; j += blockDim.x) {
        const float t124 = (a[26][j] * a[6][j]);
        const float t125 = (a[26][j] * (s + 16)[j]);
        a[27][j] = t125;
        const float t126 = (t124 * u31);
        (s + 100)[j] = t126;
        const float t127 = (t124 * a[5][j]);
        (s + 116)[j] = t127;
    }
    __syncthreads();
    // v128: f32 = sum v127
    const float u128 = cellc_block_sum((s + 116), 16, red);
    // v130: f32 = mul v128, v31
    const float u130 = (u128 * u31);
    // v131: f32 = div v130, v30
    const float u131 = (u130 / a[4][0]);
    // v132: f32 = mul v131, v83
    const float u132 = (u131 * -5e-1f);
    // v134: f32 = div v132, v133
    const float u134 = (u132 / 1.6e1f);
    // v135: [4*H] = broadcast v134
    // v136: [4*H] = mul v135, v27
    // v138: [4*H] = add v126, v136
    // v139: [4*H] = add v138, v136
    // v148: [4*H] = mul v123, v5
    // v149: [4*H] = mul v123, v21
    // v150: [4*H] = mul v148, v20
    // v151: [4*H] = mul v148, v14
    for (int j = threadIdx.x; j < 16; j += blockDim.x) {
        const float t136 = (u134 * a[5][j]);
        const float t138 = ((s + 100)[j] + t136);
        const float t139 = (t138 + t136);
        (s + 132)[j] = t139;
        const float t148 = (a[26][j] * a[2][j]);
        const float t149 = (a[26][j] * (s + 0)[j]);
        a[28][j] = t149;
        const float t150 = (t148 * u19);
        (s + 148)[j] = t150;
        const float t151 = (t148 * a[1][j]);
        (s + 164)[j] = t151;
    }
    __syncthreads();
    // v152: f32 = sum v151
    const float u152 = cellc_block_sum((s + 164), 16, red);
    // v154: f32 = mul v152, v19
    const float u154 = (u152 * u19);
    // v155: f32 = div v154, v18
    const float u155 = (u154 / a[0][0]);
    // v156: f32 = mul v155, v83
    const float u156 = (u155 * -5e-1f);
    // v157: f32 = sum v139
    const float u157 = cellc_block_sum((s + 132), 16, red);
    // v141: f32 = neg v157
    const float u141 = -(u157);
    // v143: f32 = div v141, v133
    const float u143 = (u141 / 1.6e1f);
    // v144: [4*H] = broadcast v143
    // v160: f32 = div v156, v133
    const float u160 = (u156 / 1.6e1f);
    // v161: [4*H] = broadcast v160
    // v145: [4*H] = add v139, v144
    // v162: [4*H] = mul v161, v14
    // v164: [4*H] = add v150, v162
    // v165: [4*H] = add v164, v162
    for (int j = threadIdx.x; j < 16; j += blockDim.x) {
        const float t145 = ((s + 132)[j] + u143);
        a[29][j] = t145;
        const float t162 = (u160 * a[1][j]);
        const float t164 = ((s + 148)[j] + t162);
        const float t165 = (t164 + t162);
        (s + 180)[j] = t165;
    }
    __syncthreads();
    // v122: f32 = sum v165
    const float u122 = cellc_block_sum((s + 180), 16, red);
    // v167: f32 = neg v122
    const float u167 = -(u122);
    // v169: f32 = div v167, v133
    const float u169 = (u167 / 1.6e1f);
    // v170: [4*H] = broadcast v169
    // v171: [4*H] = add v165, v170
    for (int j = threadIdx.x; j < 16; j += blockDim.x) {
        const float t171 = ((s + 180)[j] + u169);
        a[30][j] = t171;
    }
}
extern "C" __global__ void __launch_bounds__(128) layernorm_lstm_bwd_s0(float* const* __restrict__ args, int rows, float* __restrict__ scratch) {
    __shared__ float red[128];
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        layernorm_lstm_bwd_s0_row(args + (size_t)row * 31, scratch + (size_t)blockIdx.x * 196, red);
        __syncthreads();
    }
}

