// Runs an AOTInductor package (.pt2) of a model that uses cellc.RNN from C++, with no Python:
// libtorch's AOTIModelPackageLoader loads the package, whose generated code calls cellc's C
// shim (libcellc_aoti.so, linked here). The inputs and the outputs travel as one file each,
// written and read with torch::pickle_save / torch::pickle_load (Python's torch.save of a list of
// tensors with the same pickler reads them).
//
//   g++ -std=c++20 -O1 run_package.cpp -o run_package \
//       $(python3 -c "from torch.utils import cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))") \
//       -Wl,--no-as-needed -L"$TORCH_LIB" -Wl,-rpath,"$TORCH_LIB" -ltorch -ltorch_cpu -lc10 \
//       -L"$CELLC_LIB" -Wl,-rpath,"$CELLC_LIB" -lcellc_aoti
//
// --no-as-needed: the program calls nothing of libtorch.so or libcellc_aoti.so by name, but the
// package's code, loaded at run time, needs both in the process.
//   ./run_package model.pt2 inputs.pt outputs.pt
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/serialize.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <vector>

int main(int argc, char** argv) {
    if (argc != 4) {
        std::cerr << "usage: run_package MODEL.pt2 INPUTS.pt OUTPUTS.pt\n";
        return 2;
    }
    try {
        std::ifstream in(argv[2], std::ios::binary);
        std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        std::vector<at::Tensor> inputs;
        const c10::List<c10::IValue> loaded = torch::pickle_load(bytes).toList();
        for (size_t i = 0; i < loaded.size(); ++i) inputs.push_back(loaded.get(i).toTensor());
        torch::inductor::AOTIModelPackageLoader loader(argv[1]);
        std::vector<at::Tensor> outputs = loader.run(inputs);
        c10::List<at::Tensor> list;
        for (const auto& t : outputs) list.push_back(t);
        std::vector<char> out = torch::pickle_save(list);
        std::ofstream(argv[3], std::ios::binary).write(out.data(), static_cast<std::streamsize>(out.size()));
        std::cout << "ran " << outputs.size() << " outputs\n";
    } catch (const std::exception& e) {
        std::cerr << "run_package: " << e.what() << "\n";
        return 1;
    }
    return 0;
}
